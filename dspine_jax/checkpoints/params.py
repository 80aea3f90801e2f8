"""Fill a TargetModel from a name -> tensor mapping in HF's naming, checking every tensor."""

from __future__ import annotations

from typing import Callable, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspine_jax.config import TargetConfig
from dspine_jax.errors import CheckpointError
from dspine_jax.target import TargetModel, unfused_tensors

# Buffers some exporters write that carry no learned state.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

TensorSource = Mapping[str, Callable[[], np.ndarray]]  # name -> loader, read on demand


def hf_name(path: tuple) -> str:
    """Our NNX state path -> the HF tensor name."""
    name = ".".join(str(p) for p in path)
    return name if name.startswith("lm_head.") else "model." + name


def build_target(config: TargetConfig, tensors: TensorSource, *, dtype=jnp.float32,
                 source: str = "checkpoint") -> TargetModel:
    """Materialise the model with no random init: every parameter comes from `tensors`."""
    ignored = {"lm_head.weight"} if config.tie_word_embeddings else set()  # tied copies

    def hint(missing):
        return (" (config says tie_word_embeddings=false but there is no lm_head.weight)"
                if "lm_head.weight" in missing else "")
    return materialise(lambda: TargetModel(config, dtype=dtype, rngs=nnx.Rngs(0)), tensors,
                       name_of=hf_name, dtype=dtype, source=source, ignored=ignored, hint=hint)


def materialise(factory, tensors: TensorSource, *, name_of, dtype, source: str,
                ignored=frozenset(), hint=lambda missing: ""):
    """Build `factory()`'s module shape-only, then fill every variable from `tensors`,
    refusing missing, unexpected, misshapen and non-finite tensors."""
    abstract = nnx.eval_shape(factory)
    graphdef, state = nnx.split(abstract)
    flat = list(nnx.to_flat_state(state))
    expected = {name_of(path): var for path, var in flat}

    available = {n for n in tensors if not n.endswith(IGNORED_SUFFIXES)} - set(ignored)
    missing = sorted(set(expected) - available)
    unexpected = sorted(available - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: weights and config disagree{hint(missing)}. "
            + (f"Missing tensors: {_preview(missing)}. " if missing else "")
            + (f"Unexpected tensors: {_preview(unexpected)}." if unexpected else ""))

    filled = []
    for path, var in flat:
        name = name_of(path)
        array = tensors[name]()
        if tuple(array.shape) != tuple(var.shape):
            raise CheckpointError(
                f"{source}: tensor {name} has shape {tuple(array.shape)} but the config "
                f"implies {tuple(var.shape)}")
        if not np.all(np.isfinite(np.asarray(array, np.float32))):
            raise CheckpointError(f"{source}: tensor {name} holds NaN or infinite values")
        # Variables keep their declared dtype (a drafter's fixed transfer basis stays f32).
        filled.append((path, var.replace(jnp.asarray(array, getattr(var, "dtype", dtype)))))
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


def export_tensors(model: TargetModel) -> dict[str, np.ndarray]:
    """The model's parameters under HF names (numpy, their stored dtype)."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return unfused_tensors({hf_name(path): np.asarray(var[...]) for path, var in flat},
                           model.config)


def _preview(names: list[str], limit: int = 6) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
