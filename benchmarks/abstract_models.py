"""Targets and drafters of a preset's shapes with abstract weights (`nnx.eval_shape`): what
`lower_for_tpu` lowers and `tpu_roofline` counts, with no weights in memory."""

from __future__ import annotations

import dataclasses


def target_config(name: str, layers: int | None):
    """A `preset:NAME` target's config, at `layers` layers when given (reduced depth)."""
    from dspine_jax.config import PRESETS

    key = name.split(":", 1)[1] if name.startswith("preset:") else None
    if key not in PRESETS:
        raise SystemExit(f"--target must be preset:NAME with NAME one of "
                         f"{', '.join(PRESETS)}; got {name!r}")
    config = PRESETS[key]
    if layers is not None:
        if layers < 4:
            raise SystemExit(f"--layers must be at least 4 (the drafters read target layers "
                             f"1 .. L - 3), got {layers}")
        config = dataclasses.replace(config, num_hidden_layers=layers)
    return config


def abstract_target(config, dtype):
    from flax import nnx

    from dspine_jax.target import TargetModel

    return nnx.eval_shape(lambda: TargetModel(config, dtype=dtype, rngs=nnx.Rngs(0)))


def abstract_drafter(dconfig, dtype):
    """A drafter of these shapes, its weights abstract (DSpine's transfer space is a
    fixed basis of the same shapes either way)."""
    from flax import nnx

    from dspine_jax.drafters.model import BlockDrafter

    return nnx.eval_shape(lambda: BlockDrafter(dconfig, dtype=dtype, rngs=nnx.Rngs(0)))


def drafter_config(config, kind: str, layers: int, block_size: int = 16, dspine=None):
    from dspine_jax.drafters.config import DrafterConfig

    # the mask token's id changes no shape
    return DrafterConfig.for_target(config, kind=kind, num_layers=layers, mask_token_id=1,
                                    block_size=block_size, dspine=dspine)
