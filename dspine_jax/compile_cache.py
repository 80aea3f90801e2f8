"""JAX's persistent compilation cache, one folder for every front end.

A decoder's programs take tens of seconds to compile on a GPU (tens of seconds on a CPU
too); with the cache on, the next `dspine generate`, `dspine eval` or `dspine serve` of
the same shapes on the same machine loads them instead. On by default, in
`jax-compile-cache` under the cache folder (`DSPINE_CACHE_DIR`), at most 4 GiB (the least
recently used programs are dropped past that); `--compile-cache-dir` moves it, `none`
turns it off.
"""

from __future__ import annotations

from pathlib import Path

MAX_BYTES = 4 << 30


def default_folder() -> Path:
    from dspine_jax.registry import cache_dir

    return cache_dir() / "jax-compile-cache"


def use_compile_cache(folder: str | Path | None = "default") -> str | None:
    """Turn the cache on in `folder` ("default": `default_folder()`; None or "none": off).
    -> the folder in use. Call it before the first compile of the process."""
    if folder is None or str(folder).lower() == "none":
        return None
    import jax

    path = default_folder() if str(folder) == "default" else Path(folder).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    # every program, however quick its compile: a restart needs them all
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # least recently used programs go once the folder passes this size
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return str(path)
