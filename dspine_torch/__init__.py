"""PyTorch port of DSpine-JAX's drafters and speculative loop (inference only).

It imports nothing of dspine_jax: a folder written by `dspine export` loads here (or with
`transformers.AutoModel.from_pretrained(folder, trust_remote_code=True)`), and the
parity tests compare this code with golden outputs the JAX side wrote.

The drafter classes are imported on first use, so `dspine_torch.kernels` (torch and
Triton only) imports where transformers is not installed.
"""

import importlib

# The files `dspine export` copies beside the weights for trust_remote_code.
REMOTE_CODE_FILES = ("configuration_dspine.py", "modeling_dspine.py")

_LAZY = {"DFlashDraftConfig": "configuration_dspine", "DSpineDraftConfig": "configuration_dspine",
         "DFlashDraftModel": "modeling_dspine", "DSpineDraftModel": "modeling_dspine",
         "DraftContext": "modeling_dspine", "DraftOutput": "modeling_dspine",
         "Proposal": "modeling_dspine", "load_drafter": "modeling_dspine"}

__all__ = [*_LAZY, "REMOTE_CODE_FILES"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"dspine_torch.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'dspine_torch' has no attribute {name!r}")
