"""Compiled programs kept on disk whole, so that a restart neither traces nor compiles them.

JAX's persistent compilation cache (`compile_cache`) saves XLA's compile, but a program
still has to be traced and lowered to find its cache entry: for a decoder of 30 layers and
its kernels that is seconds of Python per program, and the Python of several programs
cannot run in parallel (it holds the GIL). The store keeps each compiled executable
(`jax.experimental.serialize_executable`) under a key of everything its trace depends on:

  * the code that traces it: a digest of every source file of `dspine_jax` and
    `pallas_kernels` (any edit is a new key);
  * JAX, jaxlib, the platform and its version, the devices, XLA's flags, and JAX's
    settings that change a trace (matmul precision, x64, the PRNG, ...);
  * the decoder (`BatchDecoder.program_identity`: method, model configs, attention
    backend, kernel switches, EOS ids, ...), the program's name and static arguments;
  * the structure, shapes, dtypes and shardings of every argument (the weights are
    arguments, never constants, so one program serves any checkpoint of those shapes).

An entry that cannot be read (truncated, or written by another jaxlib) is deleted and the
program compiles as before. Entries live in `programs/` of the compilation cache folder,
the least recently used dropped past `max_bytes`; `--compile-cache-dir none` turns the
store off with the cache. Entries are pickles: like JAX's own cache, only a folder the
user trusts is read.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import pickle
import tempfile
import threading
from pathlib import Path

import jax

log = logging.getLogger(__name__)

FORMAT = 1


class _CacheHits(threading.local):
    """Whether the compile running in this thread was a hit in JAX's persistent cache
    (JAX records the event in the compiling thread)."""
    hit = False


_cache_hits = _CacheHits()


def _on_event(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _cache_hits.hit = True


jax.monitoring.register_event_listener(_on_event)


def compile_fresh(lowered):
    """`lowered.compile()`, and whether the store may keep the result: not where it was
    read from JAX's persistent cache. Such an executable runs in the process that read it
    but, serialized again, not in the next one on XLA:CPU (a fused function of it is not
    found); a program compiled here is kept."""
    _cache_hits.hit = False
    executable = lowered.compile()
    return executable, not _cache_hits.hit


SUFFIX = ".program"
# the packages whose code a program's trace runs
TRACED_PACKAGES = ("dspine_jax", "pallas_kernels")


@functools.lru_cache(maxsize=None)
def code_digest() -> str:
    """sha256 of every .py file of TRACED_PACKAGES (paths and contents)."""
    digest = hashlib.sha256()
    for package in TRACED_PACKAGES:
        root = Path(__import__(package).__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def platform_identity(xla_flags: str) -> dict:
    """What the same trace compiles differently on: versions, platform, devices, flags."""
    import jaxlib

    devices = jax.devices()
    client = devices[0].client
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "platform": client.platform, "platform_version": client.platform_version,
            "devices": [d.device_kind for d in devices], "xla_flags": xla_flags}


def trace_settings() -> list[str]:
    """JAX's settings that change what a trace produces (matmul precision, x64, PRNG
    implementation, ...): what `jax.jit` itself keys its traces on, read where the program
    is traced."""
    try:
        from jax._src.config import trace_context
    except ImportError:     # a JAX without it: the settings the engine is known to meet
        return [repr(jax.config.jax_default_matmul_precision),
                repr(jax.config.jax_enable_x64), repr(jax.config.jax_default_prng_impl)]
    # an object printed with its address is no setting (the axis environment)
    return [r for r in map(repr, trace_context()) if " at 0x" not in r]


def describe_arguments(args) -> dict:
    """The tree, shapes, dtypes and shardings of a program's arguments."""
    leaves, treedef = jax.tree.flatten(args)
    return {"tree": str(treedef),
            "leaves": [[list(x.shape), str(x.dtype), str(getattr(x, "sharding", None))]
                       for x in leaves]}


class ProgramStore:
    def __init__(self, folder: str | Path, max_bytes: int, xla_flags: str = ""):
        """xla_flags: XLA's flags of this process (a program compiled under other flags
        is another entry)."""
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._platform = None
        self._xla_flags = xla_flags
        self._lock = threading.Lock()

    def key(self, identity: dict, name: str, args, static: dict) -> str:
        """The entry name of program `name` of a decoder of `identity`, traced with `args`
        and `static` arguments."""
        if self._platform is None:
            self._platform = platform_identity(self._xla_flags)
        material = {"format": FORMAT, "code": code_digest(), "platform": self._platform,
                    "jax_settings": trace_settings(),
                    "decoder": identity, "program": name, "static": static,
                    "arguments": describe_arguments(args)}
        text = json.dumps(material, sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()

    def load(self, key: str):
        """The stored program of `key` (a `jax.stages.Compiled`), or None."""
        path = self.folder / f"{key}{SUFFIX}"
        try:
            blob = path.read_bytes()
        except OSError:
            return None
        try:
            from jax.experimental import serialize_executable

            entry = pickle.loads(blob)
            if entry.get("format") != FORMAT:
                raise ValueError(f"format {entry.get('format')!r}")
            in_tree, out_tree = entry["trees"]
            program = serialize_executable.deserialize_and_load(entry["executable"],
                                                                in_tree, out_tree)
        except Exception as e:      # whatever it is, the program compiles instead
            log.warning("dropping the stored program %s (it compiles again): %r",
                        path.name, e)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)          # recently used: evicted last
        except OSError:
            pass
        return program

    def save(self, key: str, program) -> bool:
        """Keep `program` (a `jax.stages.Compiled`) as `key`; False where it cannot be
        serialized or written (the store is a cache: nothing depends on it)."""
        try:
            from jax.experimental import serialize_executable

            executable, in_tree, out_tree = serialize_executable.serialize(program)
            with io.BytesIO() as buffer:
                pickle.dump({"format": FORMAT, "trees": (in_tree, out_tree),
                             "executable": executable}, buffer)
                blob = buffer.getvalue()
        except Exception as e:
            log.info("a compiled program cannot be stored (it compiles on the next run): %r",
                     e)
            return False
        temporary = None
        try:
            # written whole, then renamed: a reader never sees half an entry
            with tempfile.NamedTemporaryFile(dir=self.folder, suffix=".tmp",
                                             delete=False) as f:
                temporary = Path(f.name)
                f.write(blob)
            os.replace(temporary, self.folder / f"{key}{SUFFIX}")
        except OSError as e:
            log.info("cannot write the program store in %s: %r", self.folder, e)
            if temporary is not None:
                temporary.unlink(missing_ok=True)
            return False
        self._evict()
        return True

    def _evict(self) -> None:
        """Drop the least recently used entries while the folder holds over max_bytes."""
        with self._lock:
            entries = []
            for path in self.folder.glob(f"*{SUFFIX}"):
                try:
                    stat = path.stat()
                except OSError:     # dropped by another process meanwhile
                    continue
                entries.append((stat.st_mtime, stat.st_size, path))
            total = sum(size for _, size, _ in entries)
            for _, size, path in sorted(entries):
                if total <= self.max_bytes:
                    break
                path.unlink(missing_ok=True)
                total -= size
