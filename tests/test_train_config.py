"""One declaration of the drafter and loss settings: TOML sections map onto the library's
own dataclasses, every field can be set, and checkpoints keep the architecture only."""

from __future__ import annotations

import dataclasses
import json

import pytest
from flax import nnx

from dspine_jax.drafters.checkpoint import save_drafter
from dspine_jax.drafters.config import (DECODING, TRAINING_ONLY_FIELDS, DrafterConfig,
                                       DSpineConfig)
from dspine_jax.errors import ConfigError
from dspine_jax.losses import LossConfig
from dspine_train.config import from_dict, load_config
from dspine_train.drafter_setup import resolved_loss
from tests.test_drafters import SPINE, TARGET, make

# A value for every field that differs from its default, by type.
CHANGED = {bool: lambda v: not v, int: lambda v: (v or 2) + 1, float: lambda v: v / 2,
           str: lambda v: "ce+l1"}


def changed_values(cls, skip=()):
    values = {}
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        default = field.default
        kind = type(default) if default is not None else {
            "gamma": float, "backbone": str, "refinement": bool, "top_k": int}[field.name]
        values[field.name] = CHANGED[kind](default if default is not None else kind())
    return values


def test_every_loss_and_dspine_field_is_settable_from_toml(tmp_path):
    loss = changed_values(LossConfig)
    loss.update(gamma=5.0, replacement_hold_ratio=0.1, replacement_end_ratio=0.2,
                candidates="kernel", logits="dense")
    dspine = changed_values(DSpineConfig)
    dspine["marginal_tail"] = False  # excludes vocabulary_chain: set on its own below
    lines = ["[drafter]", 'kind = "dspine"', "[dspine]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in dspine.items()]
    lines += ["[loss]"] + [f"{k} = {json.dumps(v)}" for k, v in loss.items()]
    (tmp_path / "c.toml").write_text("\n".join(lines) + "\n")
    cfg = load_config(tmp_path / "c.toml")
    assert cfg.dspine == DSpineConfig(**dspine)
    assert cfg.loss == LossConfig(**loss)
    # The same through --set, the TOML value syntax included.
    cfg = load_config(None, ["loss.ce_weight=0.25", "dspine.top_k=7", "loss.backbone=ce"])
    assert (cfg.loss.ce_weight, cfg.dspine.top_k, cfg.loss.backbone) == (0.25, 7, "ce")
    assert load_config(None, ["dspine.marginal_tail=true"]).dspine.marginal_tail is True


def test_the_trainer_uses_the_toml_loss_as_given():
    drafter = DrafterConfig.for_target(TARGET, kind="dspine", mask_token_id=3, dspine=SPINE)
    cfg = from_dict({"loss": {"ce_weight": 0.3, "alignment": False, "replacement_layers": 1}})
    loss = resolved_loss(cfg, drafter)
    assert (loss.ce_weight, loss.alignment, loss.replacement_layers) == (0.3, False, 1)
    assert (loss.backbone, loss.refinement, loss.top_k) == ("ce+l1", True, SPINE.top_k)


def test_bad_sections_are_named():
    with pytest.raises(ConfigError, match="loss.ce_weight must be in"):
        from_dict({"loss": {"ce_weight": 2.0}})
    with pytest.raises(ConfigError, match="unknown field dspine.ce_weight"):
        from_dict({"dspine": {"ce_weight": 0.1}})
    with pytest.raises(ConfigError, match=r"\[dspine\] section configures a DSpine drafter"):
        from_dict({"drafter": {"kind": "dflash"}, "dspine": {"top_k": 4}})
    with pytest.raises(ConfigError, match="loss.backbone must be one of"):
        from_dict({"loss": {"backbone": "mse"}})


def test_a_checkpoint_stores_the_architecture_not_the_recipe(tmp_path):
    from dspine_jax.target import TargetModel

    drafter = make(TargetModel(TARGET, rngs=nnx.Rngs(0)), "dspine")
    save_drafter(drafter, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    # The reference fields in dspine_config, the project's switches under their own key.
    stored = {**raw["dspine_config"], **raw["dspine_jax_switches"]}
    # The sampling options (dspine_jax_decoding) are written only when not the default.
    assert "dspine_jax_decoding" not in raw
    assert set(stored) | set(DECODING) == {f.name for f in dataclasses.fields(DSpineConfig)}
    assert not set(stored) & TRAINING_ONLY_FIELDS
    # A checkpoint written before the split (training fields inside) still loads.
    legacy = dict(raw)
    del legacy["dspine_jax_switches"]
    legacy["dspine_config"] = {**stored, "ce_weight": 0.1, "alignment": False,
                               "replacement_layers": 3}
    assert DrafterConfig.from_hf(legacy).dspine == DSpineConfig(**stored)
