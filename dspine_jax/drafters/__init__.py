"""DFlash and DSpine drafters: the model (`model.py`), its config and checkpoints, and the
proposers that turn a drafter pass into draft tokens and their q (`proposers.py`)."""

# The proposal paths and the kernels of DSpine's sparse proposal, by the names the engine,
# the Python API and the CLI take, and what each uses when told nothing. Kept here, free of
# imports, so that `dspine --help` shows them without loading the library.
PROPOSALS = ("sparse", "dense")
PROPOSAL_KERNELS = ("auto", "xla", "pallas")
DEFAULT_PROPOSAL = "sparse"
DEFAULT_PROPOSAL_KERNEL = "xla"
