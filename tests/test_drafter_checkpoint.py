"""Drafter export/import in the DFlash reference layout: names, config, round trip."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from typer.testing import CliRunner

from dspine_cli.main import app
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


def test_reference_layout_folds_the_map_into_the_code_table(tmp_path, target):
    """With a code table the whitening map gives way to `transfer_codes` [V, r] float32
    (the reference layout); the drafter read back from the table computes what the map
    did, in bf16 too (the table stays float32)."""
    from tests.test_losses import reference_codes

    drafter = make(target, "dspine")
    e_out = target.output_embedding()
    save_drafter(drafter, tmp_path, dtype=jnp.bfloat16, code_table=drafter.code_table(e_out))
    assert names(tmp_path) == (set(DFLASH_NAMES) | set(DSPINE_NAMES) | {"transfer_codes"}) \
        - {"transfer_whiten", "transfer_mean"}
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        table = f.get_tensor("transfer_codes")
    assert table.dtype == np.float32
    np.testing.assert_allclose(table, reference_codes(drafter, e_out, np.arange(97)),
                               atol=1e-6)
    back = load_drafter(tmp_path)
    assert back.has_code_table and not drafter.has_code_table
    map_side = load_drafter(save_drafter(drafter, tmp_path / "map", dtype=jnp.bfloat16))
    feats = features(target, drafter, TOKENS)
    args = (TOKENS, feats, ANCHORS, target.input_embedding(), e_out)
    np.testing.assert_allclose(back.forward_train(*args).logits,
                               map_side.forward_train(*args).logits, rtol=0, atol=1e-6)


# ----- SpecForge's DSpineDraftModel -----------------------------------------------------------
SPECFORGE = Path(__file__).parent / "fixtures" / "specforge_dspine_state_dict.json"


def specforge_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """SpecForge's DSpineDraftModel state dict for a config.json: name -> shape, from the
    fixture's names and shape formulas."""
    spine = config["dspine_config"]
    symbols = {**{k: v for k, v in config.items() if isinstance(v, int)},
               "F": len(config["dflash_config"]["target_layer_ids"]),
               "r": spine["transfer_rank"], "m": spine["message_size"]}
    shapes = {}
    for name, dims in json.loads(SPECFORGE.read_text())["tensors"].items():
        shape = tuple(eval(d, {"__builtins__": {}}, symbols) for d in dims)  # noqa: S307
        for layer in range(config["num_hidden_layers"]) if "{l}" in name else [None]:
            shapes[name.format(l=layer)] = shape
    return shapes


def test_dspine_export_is_specforge_state_dict(tmp_path):
    """`dspine export` of a DSpine drafter holds exactly the tensors of SpecForge's
    DSpineDraftModel, with its shapes: a strict load_state_dict finds nothing missing
    and nothing unexpected. The codes are the source drafter's whitening map over the
    target's lm_head, and the export decodes as the source does."""
    from dspine_jax.checkpoints import load_target
    from tests.test_losses import reference_codes
    from tests.torch_port_golden import FIXTURES

    out = tmp_path / "export"
    result = CliRunner().invoke(app, ["export", "--drafter", str(FIXTURES / "dspine"), "--out",
                                      str(out), "--target", str(FIXTURES / "target")])
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        exported = {name: f.get_tensor(name) for name in f.keys()}
    assert {n: t.shape for n, t in exported.items()} == specforge_shapes(config)
    assert exported["transfer_codes"].dtype == np.float32
    assert exported["transfer_ready"].dtype == np.bool_ and exported["transfer_ready"]
    assert exported["fc.weight"].dtype.name == "bfloat16"

    source = load_drafter(FIXTURES / "dspine")
    e_out = load_target(FIXTURES / "target", dtype="f32",
                        with_tokenizer=False).model.output_embedding()
    vocab = config["vocab_size"]
    np.testing.assert_allclose(exported["transfer_codes"],
                               reference_codes(source, e_out, np.arange(vocab)), atol=1e-6)
    back = load_drafter(out)
    tokens = jnp.arange(vocab)
    np.testing.assert_allclose(back.code(tokens, e_out), source.code(tokens, e_out),
                               rtol=0, atol=1e-5)


def write_specforge_checkpoint(drafter, e_out, folder):
    """`drafter` as SpecForge saves a DSpineDraftModel: the fixture's tensor names (no
    whitening map), and a config.json as its Qwen3Config writes it (all of SpecForge's
    dspine_config fields, layer_types, rope_parameters, no dspine_jax_switches)."""
    from safetensors.numpy import save_file

    from dspine_jax.drafters.checkpoint import drafter_tensors

    config = drafter.config.to_hf()
    theirs = drafter_tensors(drafter)
    theirs.update(transfer_codes=drafter.code_table(e_out), transfer_ready=np.asarray(True))
    save_file({name: np.asarray(theirs[name]) for name in specforge_shapes(config)},
              str(folder / "model.safetensors"))
    del config["dspine_jax_switches"], config["rope_theta"], config["rope_scaling"]
    config["dspine_config"].update(
        ce_weight=0.1, alignment_weight=0.5, alignment_warmup_steps=146, replacement_layers=3,
        replacement_probability=0.5, replacement_hold_ratio=1 / 6, replacement_end_ratio=1 / 3,
        candidate_mass_threshold=1e-4)
    config.update(layer_types=["full_attention"] * drafter.config.num_hidden_layers,
                  rope_parameters={"rope_theta": drafter.config.rope_theta,
                                   "rope_type": "default"},
                  use_sliding_window=False, sliding_window=None, dtype="float32")
    (folder / "config.json").write_text(json.dumps(config))


def test_specforge_checkpoint_round_trips(tmp_path, target):
    """A SpecForge-layout DSpine checkpoint reads back with load_drafter (as a code table)
    and gives the logits, transition scores and proposals the drafter it came from gives."""
    from dspine_jax.sampling import SamplingParams

    drafter = make(target, "dspine")
    e_in, e_out = target.input_embedding(), target.output_embedding()
    write_specforge_checkpoint(drafter, e_out, tmp_path)
    back = load_drafter(tmp_path)
    assert back.has_code_table and back.config == drafter.config
    feats = features(target, drafter, TOKENS)
    args = (TOKENS, feats, ANCHORS, e_in, e_out)
    np.testing.assert_allclose(back.forward_train(*args).logits,
                               drafter.forward_train(*args).logits, rtol=0, atol=1e-5)

    from pallas_kernels.dspine_proposal import transition_table

    anchor = TOKENS[:, 5]
    runs = []
    for model in (drafter, back):
        ctx = model.extend_context(model.create_context(2, 32), feats, jnp.asarray([5, 5]))
        out = model.draft_block(anchor, ctx, e_in, e_out)
        proposer = model.proposer("sparse", "xla")
        greedy = proposer.propose(out, anchor, e_out, SamplingParams.create(2),
                                  jax.random.key(0))
        sampled = proposer.propose(out, anchor, e_out, SamplingParams.create(2, 1.0),
                                   jax.random.key(0))
        # Every candidate given every candidate, through the head and the kernels' reference.
        pre, cands = out.pre_injection[:, 0, 1:], greedy.candidates
        rows = jnp.take(e_out, cands, axis=0)
        runs.append({"tokens": greedy.tokens, "candidates": cands, "q": sampled.q,
                     "head": model.transition_scores(pre, cands, rows, e_out),
                     "kernel": transition_table(pre, cands, rows, e_out,
                                                proposer.transition_weights(), 1e-6)})
    for name in ("tokens", "candidates"):
        np.testing.assert_array_equal(runs[1][name], runs[0][name], err_msg=name)
    for name in ("q", "head", "kernel"):
        np.testing.assert_allclose(runs[1][name], runs[0][name], rtol=0, atol=1e-5,
                                   err_msg=name)


def test_a_dspine_checkpoint_without_a_transfer_space_is_named(tmp_path, target):
    from safetensors.numpy import load_file, save_file

    save_drafter(make(target, "dspine"), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["transfer_whiten"], tensors["transfer_mean"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="needs its transfer space"):
        load_drafter(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["layer_types"] = ["sliding_attention", "full_attention"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="only full-attention draft layers"):
        load_drafter(tmp_path)
