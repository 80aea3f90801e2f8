"""Which compiled implementation an op's `implementation="auto"` means on this backend."""

from __future__ import annotations

import jax


def backend_implementation() -> str:
    """pallas_gpu on a CUDA GPU, pallas_tpu on a TPU, xla elsewhere (CPU, ROCm)."""
    platform = jax.default_backend()
    if platform == "gpu":
        version = jax.devices()[0].client.platform_version.lower()
        return "xla" if "rocm" in version else "pallas_gpu"
    if platform == "tpu":
        return "pallas_tpu"
    return "xla"
