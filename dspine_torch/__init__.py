"""PyTorch port of DSpine-JAX's drafters and speculative loop (inference only).

It imports nothing of dspine_jax: a folder written by `dspine export` loads here (or with
`transformers.AutoModel.from_pretrained(folder, trust_remote_code=True)`), and the
parity tests compare this code with golden outputs the JAX side wrote.
"""

from dspine_torch.configuration_dspine import DFlashDraftConfig, DSpineDraftConfig
from dspine_torch.modeling_dspine import (DFlashDraftModel, DraftContext, DraftOutput,
                                          DSpineDraftModel, Proposal, load_drafter)

# The files `dspine export` copies beside the weights for trust_remote_code.
REMOTE_CODE_FILES = ("configuration_dspine.py", "modeling_dspine.py")

__all__ = ["DFlashDraftConfig", "DSpineDraftConfig", "DFlashDraftModel", "DSpineDraftModel",
           "DraftContext", "DraftOutput", "Proposal", "load_drafter", "REMOTE_CODE_FILES"]
