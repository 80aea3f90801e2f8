"""What this backend offers the kernels: which compiled implementation an op's
`implementation="auto"` means, and how many multiprocessors a grid is sized for."""

from __future__ import annotations

import jax

DEFAULT_MULTIPROCESSORS = 132  # H100/H200 SXM, where the device does not say


def backend_implementation() -> str:
    """pallas_gpu on a CUDA GPU, pallas_tpu on a TPU, xla elsewhere (CPU, ROCm)."""
    platform = jax.default_backend()
    if platform == "gpu":
        version = jax.devices()[0].client.platform_version.lower()
        return "xla" if "rocm" in version else "pallas_gpu"
    if platform == "tpu":
        return "pallas_tpu"
    return "xla"


def multiprocessors() -> int:
    """The device's multiprocessor count (what a kernel's grid fills), or
    DEFAULT_MULTIPROCESSORS where the device does not say."""
    return getattr(jax.devices()[0], "core_count", None) or DEFAULT_MULTIPROCESSORS
