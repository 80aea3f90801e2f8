"""Triton kernels for the PyTorch port, one folder per op (mirroring `pallas_kernels/`):

  dspine_proposal/   per-slot top-C over the vocabulary, DSpine's C x C transition scores,
                     the chain walk (T = 0 argmax, T > 0 warped sampling) -> ids, sparse q
  gated_injection/   one drafter layer's DSpine write (normalised readout, gate, message,
                     residual write), fused
  acceptance/        the verification rule of one block (argmax prefix at T = 0,
                     speculative sampling with the residual at T > 0, sparse or dense q)

Each folder holds `reference.py` (plain PyTorch: the documentation of what the kernel
computes), `triton_kernel.py` (the kernel) and, in its `__init__`, one public function
with an `implementation="torch" | "triton"` switch. Kernels import nothing of the
library; the library (`dspine_torch.speculative`) imports them.

Triton runs on CUDA tensors, or on CPU tensors under Triton's interpreter
(`TRITON_INTERPRET=1` set before the first kernel module is imported).
"""

from dspine_torch.kernels.common import IMPLEMENTATIONS, check_implementation

__all__ = ["IMPLEMENTATIONS", "check_implementation"]
