"""Load a target (model + tokenizer) from a built-in name, an HF folder or a GGUF file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

from dspine_jax.checkpoints import hf
from dspine_jax.checkpoints.gguf_file import GGUFCheckpoint
from dspine_jax.checkpoints.params import build_target, export_tensors
from dspine_jax.config import TargetConfig
from dspine_jax.errors import CheckpointError, ConfigError
from dspine_jax.registry import resolve_target
from dspine_jax.target import TargetModel
from dspine_jax.tokenizer import TextTokenizer

DTYPES = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16,
          "bf16": jnp.bfloat16}


@dataclasses.dataclass
class LoadedTarget:
    model: TargetModel
    tokenizer: TextTokenizer | None
    config: TargetConfig
    source: Path


def resolve_dtype(name: str):
    """'auto' is bfloat16 on accelerators and float32 on the CPU (XLA's CPU bf16 is slow)."""
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if name not in DTYPES:
        raise ConfigError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def load_target(name_or_path: str | Path, *, dtype: str = "auto",
                with_tokenizer: bool = True) -> LoadedTarget:
    jdtype = resolve_dtype(dtype)
    if str(name_or_path).startswith("preset:"):
        return _random_preset(str(name_or_path), jdtype)
    path = resolve_target(str(name_or_path))
    if path.is_dir():
        config = hf.read_config(path)
        model = build_target(config, hf.tensor_source(path), dtype=jdtype, source=str(path))
        tokenizer = TextTokenizer.from_hf_folder(path) if with_tokenizer else None
    elif path.suffix == ".gguf":
        ckpt = GGUFCheckpoint(path)
        config = ckpt.config()
        model = build_target(config, ckpt.tensor_source(), dtype=jdtype, source=str(path))
        tokenizer = TextTokenizer.from_gguf(ckpt) if with_tokenizer else None
    else:
        raise CheckpointError(f"{path}: expected an HF checkpoint folder or a .gguf file")
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"{path}: tokenizer has {tokenizer.vocab_size} tokens but the "
                              f"model's vocabulary has {config.vocab_size} rows")
    return LoadedTarget(model=model, tokenizer=tokenizer, config=config, source=path)


def _random_preset(name: str, dtype) -> LoadedTarget:
    """`preset:NAME`: random weights with a published model's shapes and no tokenizer, for
    benchmarks whose timing does not depend on weight values."""
    from flax import nnx

    from dspine_jax.config import PRESETS

    key = name.split(":", 1)[1]
    if key not in PRESETS:
        raise ConfigError(f"unknown preset {key!r}; known: {', '.join(PRESETS)}")
    config = PRESETS[key]
    model = TargetModel(config, dtype=dtype, rngs=nnx.Rngs(0))
    return LoadedTarget(model=model, tokenizer=None, config=config, source=Path(name))


def save_target(model: TargetModel, folder: str | Path) -> None:
    """An HF folder (config.json + model.safetensors) that transformers reads back."""
    hf.save_folder(Path(folder), model.config, export_tensors(model))


__all__ = ["LoadedTarget", "load_target", "save_target", "resolve_dtype", "build_target"]
