"""Drafter export/import in the DFlash reference layout: names, config, round trip."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from typer.testing import CliRunner

from dspine_jax.cli import app
from dspine_jax.drafters.checkpoint import load_drafter, save_drafter
from dspine_jax.drafters.config import DrafterConfig
from dspine_jax.errors import CheckpointError, ConfigError
from tests.test_drafters import ANCHORS, TARGET, TOKENS, features, make


def dflash_names(layers: int) -> list[str]:
    return ["fc.weight", "hidden_norm.weight", "norm.weight"] + [
        f"layers.{i}.{n}" for i in range(layers) for n in (
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
            "input_layernorm.weight", "post_attention_layernorm.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]


DFLASH_NAMES = dflash_names(2)
DSPINE_NAMES = ["injection.message.weight", "injection.receiver_gate.weight",
                "injection.predecessor_gate.weight", "injection.bias", "transfer_whiten",
                "transfer_mean", "transfer_ready"] + [
    f"injection.{part}.{i}.weight" for part in ("readouts", "writes") for i in range(2)]


@pytest.fixture(scope="module")
def target():
    from dspine_jax.target import TargetModel

    return TargetModel(TARGET, rngs=nnx.Rngs(0))


def names(folder):
    with safe_open(str(folder / "model.safetensors"), framework="numpy") as f:
        return set(f.keys())


@pytest.mark.parametrize("kind", ["dflash", "dspine"])
def test_round_trip_gives_identical_outputs(tmp_path, target, kind):
    drafter = make(target, kind)
    save_drafter(drafter, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel" if kind == "dflash" else "DSpineDraftModel"]
    assert cfg["block_size"] == 4 and cfg["num_hidden_layers"] == 2
    assert cfg["num_target_layers"] == 6
    assert cfg["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [1, 3],
                                    "block_size": 4}
    expected = set(DFLASH_NAMES) | (set(DSPINE_NAMES) if kind == "dspine" else set())
    assert names(tmp_path) == expected
    if kind == "dspine":
        assert cfg["dspine_config"]["transfer_rank"] == 32
    back = load_drafter(tmp_path)
    assert back.config == drafter.config
    feats = features(target, drafter, TOKENS)
    args = (TOKENS, feats, ANCHORS, target.input_embedding(), target.output_embedding())
    np.testing.assert_array_equal(back.forward_train(*args).logits,
                                  drafter.forward_train(*args).logits)


def test_bf16_export_stays_close(tmp_path, target):
    drafter = make(target, "dspine")
    save_drafter(drafter, tmp_path, dtype=jnp.bfloat16)
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        assert str(f.get_tensor("fc.weight").dtype) == "bfloat16"
        assert str(f.get_tensor("transfer_whiten").dtype) == "float32"  # fixed basis: exact
    back = load_drafter(tmp_path)
    feats = features(target, drafter, TOKENS)
    args = (TOKENS, feats, ANCHORS, target.input_embedding(), target.output_embedding())
    a, b = back.forward_train(*args).logits, drafter.forward_train(*args).logits
    assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 2e-2


def test_cli_export_and_refusals(tmp_path, target):
    save_drafter(make(target, "dflash"), tmp_path / "src")
    runner = CliRunner()
    result = runner.invoke(app, ["export", "--drafter", str(tmp_path / "src"), "--format",
                                 "dflash-hf", "--out", str(tmp_path / "out"), "--dtype", "f32"])
    assert result.exit_code == 0, result.output
    assert names(tmp_path / "out") == set(DFLASH_NAMES)
    again = runner.invoke(app, ["export", "--drafter", str(tmp_path / "src"),
                                "--out", str(tmp_path / "out")])
    assert again.exit_code == 2 and "already exists and is not empty" in again.output
    unknown = runner.invoke(app, ["export", "--drafter", "smollm2-135m-instruct-medusa",
                                  "--out", str(tmp_path / "x")])
    assert unknown.exit_code == 2 and "neither a built-in name" in unknown.output


def test_dspine_export_without_the_code_table(tmp_path, target):
    save_drafter(make(target, "dspine"), tmp_path / "src")
    result = CliRunner().invoke(app, ["export", "--drafter", str(tmp_path / "src"), "--out",
                                      str(tmp_path / "out"), "--no-code-table"])
    assert result.exit_code == 0, result.output
    assert names(tmp_path / "out") == set(DFLASH_NAMES) | set(DSPINE_NAMES)


def test_builtin_drafters_load_and_export_unchanged(tmp_path):
    """The shipped drafters: the bf16 weights survive load + export bit for bit."""
    from safetensors.numpy import load_file

    from dspine_jax.registry import BUILTIN_DRAFTERS, resolve_drafter

    folder = resolve_drafter("smollm2-135m-instruct-dflash")
    result = CliRunner().invoke(app, ["export", "--drafter", "smollm2-135m-instruct-dflash",
                                      "--out", str(tmp_path / "x"), "--dtype", "bf16"])
    assert result.exit_code == 0, result.output
    shipped, exported = (load_file(str(f / "model.safetensors")) for f in (folder, tmp_path / "x"))
    assert shipped.keys() == exported.keys() == set(dflash_names(5))
    assert all(np.array_equal(shipped[k], exported[k]) for k in shipped)
    for name in BUILTIN_DRAFTERS:
        config = load_drafter(resolve_drafter(name)).config
        kind = name.rsplit("-", 1)[1]
        assert (config.kind, config.num_hidden_layers, config.block_size) == (kind, 5, 16)


def test_a_corrupt_builtin_drafter_is_refused(tmp_path, monkeypatch):
    import shutil

    from dspine_jax import registry

    name = "smollm2-135m-instruct-dflash"
    shutil.copytree(registry.DRAFTER_ASSETS / name, tmp_path / name)
    weights = tmp_path / name / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    monkeypatch.setattr(registry, "DRAFTER_ASSETS", tmp_path)
    with pytest.raises(CheckpointError, match="sha256 .* does not match built-in drafter"):
        registry.resolve_drafter(name)


def test_bad_drafter_checkpoints_are_named(tmp_path, target):
    save_drafter(make(target, "dspine"), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["dspine_config"]["transfer_rank"] = 16
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"tensor injection\.\S+ has shape .* but the config"):
        load_drafter(tmp_path)
    cfg["dspine_config"]["bogus"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unknown field.*bogus"):
        load_drafter(tmp_path)
    del cfg["dspine_config"]["bogus"]
    del cfg["dflash_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="lacks field 'mask_token_id'"):
        load_drafter(tmp_path)
    with pytest.raises(ConfigError, match="not a DFlash/DSpine drafter"):
        DrafterConfig.from_hf({"architectures": ["LlamaForCausalLM"]})


def test_reference_layout_carries_the_code_table(tmp_path, target):
    """The export adds `transfer_codes` [V, r] (the reference layout); loading ignores it
    because the whitening map and the target's lm_head define the same codes."""
    from tests.test_losses import reference_codes

    drafter = make(target, "dspine")
    e_out = target.output_embedding()
    save_drafter(drafter, tmp_path, code_table=drafter.code_table(e_out))
    assert names(tmp_path) == set(DFLASH_NAMES) | set(DSPINE_NAMES) | {"transfer_codes"}
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        table = f.get_tensor("transfer_codes")
    np.testing.assert_allclose(table, reference_codes(drafter, e_out, np.arange(97)),
                               atol=1e-5)
    back = load_drafter(tmp_path)
    feats = features(target, drafter, TOKENS)
    args = (TOKENS, feats, ANCHORS, target.input_embedding(), e_out)
    np.testing.assert_array_equal(back.forward_train(*args).logits,
                                  drafter.forward_train(*args).logits)
