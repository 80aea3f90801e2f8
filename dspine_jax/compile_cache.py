"""JAX's persistent compilation cache and the program store, one folder for every front end.

A decoder's programs take tens of seconds to compile on a GPU (tens of seconds on a CPU
too); with the cache on, the next `dspine generate`, `dspine eval` or `dspine serve` of
the same shapes on the same machine loads them instead. On by default, in
`jax-compile-cache` under the cache folder (`DSPINE_CACHE_DIR`), at most 4 GiB (the least
recently used programs are dropped past that); `--compile-cache-dir` moves it, `none`
turns it off. Beside JAX's entries, `programs/` keeps the engine's compiled programs whole
(`program_store`), so a restart does not trace them either, up to another 4 GiB.
"""

from __future__ import annotations

import os
from pathlib import Path

from dspine_jax.program_store import ProgramStore

MAX_BYTES = 4 << 30

_store: ProgramStore | None = None


def default_folder() -> Path:
    from dspine_jax.registry import cache_dir

    return cache_dir() / "jax-compile-cache"


def use_compile_cache(folder: str | Path | None = "default") -> str | None:
    """Turn the cache and the program store on in `folder` ("default": `default_folder()`;
    None or "none": both off). -> the folder in use. Call it before the first compile of
    the process."""
    global _store
    if folder is None or str(folder).lower() == "none":
        _store = None
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
    # XLA reads its flags from the environment once per process: read here, with the cache
    _store = ProgramStore(path / "programs", MAX_BYTES,
                          xla_flags=os.environ.get("XLA_FLAGS", ""))
    return str(path)


def program_store() -> ProgramStore | None:
    """The store `use_compile_cache` turned on, or None."""
    return _store
