"""The PyTorch port (dspine_torch) against independent references.

* the JAX side's golden records (tests/fixtures/torch_port, written by
  tests/torch_port_golden.py): the PyTorch tests read them without running JAX;
* transformers' own greedy decoding of the same target (T = 0 is lossless);
* the target distribution p itself (speculative sampling with the residual is exact).
The JAX tests at the end regenerate the golden records, check the export layout, and
load an export with `trust_remote_code=True`.
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
import transformers

from dspine_torch import DFlashDraftModel, DSpineDraftModel, load_drafter
from dspine_torch.modeling_dspine import warp_logits
from dspine_torch.speculative import Sampling, generate, generate_batch, residual, verify
from dspine_torch.stages import torch_stages
from tests.torch_port_golden import (FIXTURES, KINDS, MAX_NEW_TOKENS, PROMPTS, Q_TEMPERATURE,
                                     TARGET, unpack)

FLOAT_TOLERANCE = 1e-4   # f32 max abs difference, every float stage
EXACT = ("first_token", "draft_tokens", "candidates", "num_accepted", "tokens",
         "accept_lengths")


@pytest.fixture(scope="module")
def target():
    return transformers.AutoModelForCausalLM.from_pretrained(
        FIXTURES / "target", dtype=torch.float32).eval()


def golden(kind: str) -> dict:
    return dict(np.load(FIXTURES / f"golden_{kind}.npz"))


def assert_records_agree(ours: dict, reference: dict, tolerance: float = FLOAT_TOLERANCE):
    assert ours.keys() == reference.keys()
    for name, ref in reference.items():
        got = ours[name]
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        if name in EXACT:
            np.testing.assert_array_equal(got, ref, err_msg=name)
        else:
            diff = float(np.max(np.abs(got.astype(np.float64) - ref)))
            assert diff <= tolerance, f"{name}: max abs difference {diff:.3g} > {tolerance}"
    # Every drafted slot's argmax agrees (slot 0 is the anchor and never drafted).
    np.testing.assert_array_equal(ours["draft_logits"][1:].argmax(-1),
                                  reference["draft_logits"][1:].argmax(-1))


# ----- PyTorch side against the JAX goldens -----------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_torch_stages_match_the_jax_goldens(target, kind):
    drafter = load_drafter(FIXTURES / kind)
    assert type(drafter) is (DFlashDraftModel if kind == "dflash" else DSpineDraftModel)
    gold = golden(kind)
    for i, prompt in enumerate(PROMPTS):
        ours = torch_stages(target, drafter, prompt, max_new_tokens=MAX_NEW_TOKENS,
                            q_temperature=Q_TEMPERATURE)
        assert_records_agree(ours, unpack(gold, i))


def test_goldens_exercise_acceptance():
    """The fixtures only test the accept path (cache rollback, context growth) if some
    verify pass keeps drafts."""
    for kind in KINDS:
        gold = golden(kind)
        lengths = np.concatenate([unpack(gold, i)["accept_lengths"] for i in range(len(PROMPTS))])
        assert lengths.max() > 1, kind
        assert all(len(unpack(gold, i)["tokens"]) == MAX_NEW_TOKENS for i in range(len(PROMPTS)))


# ----- PyTorch side against transformers and against p -----------------------------------------
def llama_target():
    """A Llama target with the fixture's shapes (tied embeddings): the drafters run on it."""
    torch.manual_seed(3)
    config = transformers.LlamaConfig(**{**TARGET, "tie_word_embeddings": True,
                                         "rope_theta": 1e5})
    return transformers.LlamaForCausalLM(config).float().eval()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_speculative_decoding_is_the_targets_greedy_decoding(target, kind, family):
    model = target if family == "qwen3" else llama_target()
    drafter = load_drafter(FIXTURES / kind)
    prompt = PROMPTS[1]
    with torch.no_grad():
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                   min_new_tokens=20, eos_token_id=None, pad_token_id=0)
    gen = generate(model, drafter, prompt, max_new_tokens=20, ignore_eos=True)
    assert gen.tokens == reference[0, len(prompt):].tolist()
    assert sum(gen.accept_lengths) == 19 and all(1 <= n <= 5 for n in gen.accept_lengths)


# Ragged prompts: two lengths of the same text, a short one, a long one.
BATCH_PROMPTS = [PROMPTS[0], PROMPTS[1], PROMPTS[0][:3], PROMPTS[2] + [5, 9, 11, 40]]


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_batched_greedy_decoding_is_each_rows_greedy_decoding(target, kind):
    """Rows of different lengths accept different counts every step (holes in the padded
    cache, per-row positions) and finish at different steps (an EOS, then the budget):
    each row is transformers' own greedy decoding of its prompt alone, and the batch-of-
    one loop's."""
    drafter = load_drafter(FIXTURES / kind)
    refs = [hf_greedy(target, p, 20) for p in BATCH_PROMPTS]
    eos = refs[1][6]                         # row 1 stops early, the others may too
    gens = generate_batch(target, drafter, BATCH_PROMPTS, max_new_tokens=20,
                          eos_token_ids=[eos])
    for prompt, ref, gen in zip(BATCH_PROMPTS, refs, gens):
        want = ref[:ref.index(eos) + 1] if eos in ref else ref
        assert gen.tokens == want
        assert sum(gen.accept_lengths) == len(want) - 1
        assert gen == generate(target, drafter, prompt, max_new_tokens=20,
                               eos_token_ids=[eos])
    assert len(gens[1].tokens) < 20 and len({len(g.accept_lengths) for g in gens}) > 1
    assert max(max(g.accept_lengths) for g in gens) > 1


def test_batched_greedy_decoding_on_a_llama_target():
    model = llama_target()
    drafter = load_drafter(FIXTURES / "dspine")
    gens = generate_batch(model, drafter, BATCH_PROMPTS, max_new_tokens=12, ignore_eos=True)
    assert [g.tokens for g in gens] == [hf_greedy(model, p, 12) for p in BATCH_PROMPTS]


@pytest.mark.parametrize("kind", KINDS)
def test_batched_sampling_draws_each_rows_own_numbers(target, kind):
    """T > 0: row i of a batch is the batch-of-one run with row i's seed (its draws come
    from its own generator, whatever else is in the batch)."""
    drafter = load_drafter(FIXTURES / kind)
    sampling = Sampling(temperature=0.9, top_p=0.9, top_k=20)
    gens = generate_batch(target, drafter, BATCH_PROMPTS, max_new_tokens=14,
                          sampling=sampling, seeds=[7, 8, 9, 10])
    for i, prompt in enumerate(BATCH_PROMPTS):
        assert gens[i] == generate(target, drafter, prompt, max_new_tokens=14,
                                   sampling=sampling, seed=7 + i)
    assert len({tuple(g.tokens) for g in gens[:2]}) == 2


def test_batched_sampling_follows_p(target):
    """The second token of many sampled rows of one prompt (the first verify pass:
    an accepted draft, or the residual/bonus draw) is distributed as the target's
    marginal sum_a p(a | prompt) p(v | prompt, a) under the same warp. 3000 rows."""
    drafter = load_drafter(FIXTURES / "dspine")
    sampling = Sampling(temperature=1.0, top_p=0.95, top_k=30)
    rows = 3000
    prompt = PROMPTS[0]
    gens = generate_batch(target, drafter, [prompt] * rows, max_new_tokens=3,
                          sampling=sampling, seed=11)
    vocab = TARGET["vocab_size"]
    counts = np.bincount([g.tokens[1] for g in gens], minlength=vocab)
    with torch.no_grad():
        first = sampling.probabilities(target(torch.tensor([prompt])).logits[0, -1])
        grid = torch.cat([torch.tensor([prompt] * vocab), torch.arange(vocab)[:, None]], 1)
        second = sampling.probabilities(target(grid).logits[:, -1])               # [V, V]
    marginal = (first @ second).numpy()
    freq = counts / rows
    sigma = np.sqrt(marginal * (1 - marginal) / rows) + 1e-12
    assert np.all(np.abs(freq - marginal) <= 4 * sigma + 1e-9), np.abs(freq - marginal).max()
    # Some rows kept the first draft (the accept path ran), some did not (the residual).
    drafted = sum(g.accept_lengths[0] >= 2 for g in gens)
    assert 0 < drafted < rows


def test_speculative_sampling_follows_p():
    """One draft from q, verify against p: the emitted token is distributed as p
    (the residual makes up what the acceptance test removed). 20k draws, 4 tokens."""
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.6, 0.1, 0.2]])
    g = torch.Generator().manual_seed(0)
    counts = np.zeros(4)
    draws = 20000
    drafts = torch.multinomial(q[0], draws, replacement=True, generator=g)
    for d in drafts:
        n, nxt = verify(d[None], q, p, g)
        counts[int(d) if n == 1 else nxt] += 1
    freq = counts / draws
    sigma = np.sqrt(p[0].numpy() * (1 - p[0].numpy()) / draws)
    assert np.all(np.abs(freq - p[0].numpy()) < 4 * sigma), freq


def test_verify_without_the_residual_would_fail():
    """The check above can fail: sampling the correction from p instead of the residual
    gives a visibly different distribution."""
    p, q = torch.tensor([0.5, 0.2, 0.2, 0.1]), torch.tensor([0.1, 0.6, 0.1, 0.2])
    accept = torch.minimum(torch.ones(4), p / q)
    wrong = q * accept + (1 - (q * accept).sum()) * p
    assert torch.max(torch.abs(wrong - p)) > 0.05
    right = q * accept + (1 - (q * accept).sum()) * residual(p, q)
    torch.testing.assert_close(right, p)


def test_sampled_decoding_is_seeded_and_consistent(target):
    drafter = load_drafter(FIXTURES / "dspine")
    sampling = Sampling(temperature=1.0, top_p=0.9, top_k=20)
    a = generate(target, drafter, PROMPTS[0], max_new_tokens=16, sampling=sampling, seed=5)
    b = generate(target, drafter, PROMPTS[0], max_new_tokens=16, sampling=sampling, seed=5)
    assert a == b and len(a.tokens) == 16 and sum(a.accept_lengths) == 15
    assert all(0 <= t < TARGET["vocab_size"] for t in a.tokens)


def test_warp_keeps_top_k_then_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    kept = torch.isfinite(warp_logits(logits, 1.0, top_p=0.7, top_k=3))
    assert kept.tolist() == [[True, True, False, False, False]]
    assert torch.isfinite(warp_logits(logits, 0.5, top_k=0)).all()


def test_strict_loading_refuses_bad_folders(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "d"
    shutil.copytree(FIXTURES / "dspine", folder)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, "extra.weight": torch.zeros(2)}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected: \\['extra.weight'\\]"):
        load_drafter(folder)
    save_file({k: v for k, v in tensors.items() if k != "injection.bias"},
              str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="Missing: \\['injection.bias'\\]"):
        load_drafter(folder)
    save_file({**tensors, "transfer_ready": torch.tensor(False)},
              str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="transfer_ready is False"):
        load_drafter(folder)
    save_file({**tensors, "fc.weight": tensors["fc.weight"][:, :-1].contiguous()},
              str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="tensor fc.weight has shape"):
        load_drafter(folder)


def test_the_code_table_and_the_whitening_map_agree(target):
    """The fixture carries both (the map is used); the reference layout carries only the
    table."""
    drafter = load_drafter(FIXTURES / "dspine")
    assert drafter.has_transfer_map
    assert set(drafter.state_dict()) >= {"transfer_codes", "transfer_ready"}
    assert not {"transfer_whiten", "transfer_mean"} & set(drafter.state_dict())
    e_out = target.get_output_embeddings().weight
    tokens = torch.arange(TARGET["vocab_size"])
    from_table = math.sqrt(drafter.config.transfer_rank) * drafter.transfer_codes[tokens]
    torch.testing.assert_close(drafter.codes(tokens, e_out), from_table, atol=1e-5, rtol=0)


def test_shipped_checkpoints_in_the_old_layout_load():
    """Built-in drafters keep the switches inside dspine_config and have no
    transfer_ready: they still load, with all switches on."""
    from dspine_jax.registry import resolve_drafter

    drafter = load_drafter(resolve_drafter("smollm2-135m-instruct-dspine"), dtype=torch.bfloat16)
    assert drafter.config.dspine_jax_switches == {
        "injection": True, "causal_block": True, "refinement_head": True}
    assert drafter.fc.weight.dtype == torch.bfloat16
    assert drafter.has_transfer_map and bool(drafter.transfer_ready)
    assert drafter.transfer_whiten.dtype == drafter.transfer_mean.dtype == torch.float32


# ----- JAX side: goldens, export layout, trust_remote_code ----------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_jax_side_reproduces_the_golden_records(kind):
    from tests.torch_port_golden import records

    fresh = records(kind=kind)
    gold = golden(kind)
    assert fresh.keys() == gold.keys()
    # Tighter than the cross-framework tolerance, looser than float32 noise across
    # machines: XLA's CPU code rounds differently by processor (up to 1.3e-5 seen on
    # logits made elsewhere); the exact fields (tokens, candidates, accepted lengths) stay
    # exact.
    for i in range(len(PROMPTS)):
        assert_records_agree(unpack(fresh, i), unpack(gold, i), tolerance=5e-5)


def export(tmp_path, source, *extra):
    from typer.testing import CliRunner

    from dspine_cli.main import app

    out = tmp_path / "export"
    result = CliRunner().invoke(app, ["export", "--drafter", str(source), "--out", str(out),
                                      "--target", str(FIXTURES / "target"), "--dtype", "f32",
                                      *extra])
    return result, out


@pytest.mark.parametrize("kind", KINDS)
def test_export_loads_with_trust_remote_code(tmp_path, target, kind):
    result, out = export(tmp_path, FIXTURES / kind)
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    name = "DFlash" if kind == "dflash" else "DSpine"
    assert config["auto_map"] == {"AutoConfig": f"configuration_dspine.{name}DraftConfig",
                                  "AutoModel": f"modeling_dspine.{name}DraftModel"}
    if kind == "dspine":
        assert config["dspine_config"] == {"transfer_rank": 16, "message_size": 8, "top_k": 4}
        assert config["dspine_jax_switches"] == {"injection": True, "causal_block": True,
                                                 "refinement_head": True}
    model, info = transformers.AutoModel.from_pretrained(
        out, trust_remote_code=True, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == f"{name}DraftModel"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    if kind == "dspine":
        assert bool(model.transfer_ready) and model.transfer_codes.dtype == torch.float32
        assert not model.has_transfer_map
    strict = load_drafter(out)
    e_in, e_out = (target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    features = torch.randn(1, 6, 2 * TARGET["hidden_size"], generator=torch.Generator()
                           .manual_seed(0))
    with torch.no_grad():
        outs = [m.eval()(torch.tensor([7]), m.extend_context(m.new_context(), features),
                         e_in, e_out) for m in (model, strict)]
    torch.testing.assert_close(outs[0].logits, outs[1].logits, atol=0, rtol=0)
    with torch.no_grad():  # the export (a code table) drafts what its source (a map) does
        source = load_drafter(FIXTURES / kind)
        ref = source(torch.tensor([7]), source.extend_context(source.new_context(), features),
                     e_in, e_out)
    torch.testing.assert_close(outs[1].logits, ref.logits, atol=1e-5, rtol=0)


def test_export_refuses_a_switch_the_reference_cannot_represent(tmp_path):
    import dataclasses

    from dspine_jax.drafters.checkpoint import load_drafter as jax_load, save_drafter

    drafter = jax_load(FIXTURES / "dspine")
    config = drafter.config
    drafter.config = dataclasses.replace(config, dspine=dataclasses.replace(
        config.dspine, causal_block=False))
    save_drafter(drafter, tmp_path / "ablation")
    saved = json.loads((tmp_path / "ablation" / "config.json").read_text())
    assert saved["dspine_jax_switches"]["causal_block"] is False
    assert set(saved["dspine_config"]) == {"transfer_rank", "message_size", "top_k"}
    assert jax_load(tmp_path / "ablation").config == drafter.config      # round trip
    assert load_drafter(tmp_path / "ablation").config.switch("causal_block") is False
    result, _ = export(tmp_path, tmp_path / "ablation")
    assert result.exit_code == 2 and "causal_block=False" in result.output


def test_both_config_layouts_read_alike():
    from dspine_jax.drafters.config import DrafterConfig
    from dspine_jax.errors import ConfigError

    new = json.loads((FIXTURES / "dspine" / "config.json").read_text())
    old = {k: v for k, v in new.items() if k != "dspine_jax_switches"}
    old["dspine_config"] = {**new["dspine_config"], **new["dspine_jax_switches"],
                            "ce_weight": 0.1}
    assert DrafterConfig.from_hf(old) == DrafterConfig.from_hf(new)
    clash = {**new, "dspine_config": {**new["dspine_config"], "injection": False}}
    with pytest.raises(ConfigError, match="injection=False disagrees"):
        DrafterConfig.from_hf(clash)


def test_remote_code_files_import_only_torch_and_transformers():
    """What an export ships must run where only torch and transformers are installed."""
    import ast
    import importlib.util
    from pathlib import Path

    from dspine_torch import REMOTE_CODE_FILES

    allowed = {"__future__", "dataclasses", "json", "math", "pathlib", "torch", "transformers",
               "safetensors"}
    folder = Path(importlib.util.find_spec("dspine_torch").origin).parent
    for file in REMOTE_CODE_FILES:
        tree = ast.parse((folder / file).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            assert {n.split(".")[0] for n in names} <= allowed, (file, names)


def test_parity_command(tmp_path):
    from typer.testing import CliRunner

    from dspine_cli.main import app

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"token_ids": PROMPTS[1]}) + "\n")
    args = ["parity", "--target", str(FIXTURES / "target"), "--drafter",
            str(FIXTURES / "dspine"), "--max-new-tokens", "8"]
    result = CliRunner().invoke(app, args + ["--prompts", str(prompts)])
    assert result.exit_code == 0, result.output
    assert "draft_logits" in result.output and "all stages within tolerance" in result.output
    prompts.write_text(json.dumps({"prompt": "text needs a tokenizer"}) + "\n")
    bad = CliRunner().invoke(app, args + ["--prompts", str(prompts)])
    assert bad.exit_code == 2 and "has a tokenizer" in bad.output


def test_parity_comparison_fails_on_drift():
    from dspine_jax.parity import compare

    reference = unpack(golden("dspine"), 0)
    drifted = {**reference, "draft_logits": reference["draft_logits"] + 2e-4,
               "tokens": np.roll(reference["tokens"], 1)}
    failed = {r.stage for r in compare(reference, drifted) if not r.ok}
    assert failed == {"draft_logits", "tokens", "token_disagreement"}


def test_near_tied_candidates_in_another_order_agree():
    """Two candidates whose draft logits are near-equal may come out of top-C in either
    order: the same set, with the transition scores and q permuted alike, is parity
    (the real SmolLM2 pair swapped ranks 12 and 13 of a slot, logits 1.4e-5 apart); a
    different candidate, or a table not permuted with its candidates, is not."""
    from dspine_jax.parity import compare

    reference = unpack(golden("dspine"), 0)
    slot, (i, j) = 2, (1, 2)

    def swapped(record):
        out = {k: np.array(v) for k, v in record.items()}
        out["candidates"][slot, [i, j]] = out["candidates"][slot, [j, i]]
        for name in ("transition", "q"):
            out[name][slot][:, [i, j]] = out[name][slot][:, [j, i]]   # this slot's columns
            out[name][slot + 1][[i, j]] = out[name][slot + 1][[j, i]]  # the next one's rows
        return out

    def failed(other):
        return {r.stage for r in compare(reference, other, q_temperature=0.8) if not r.ok}

    assert failed(swapped(reference)) == set()
    unpermuted = {**reference, "candidates": swapped(reference)["candidates"]}
    assert "transition" in failed(unpermuted)
    other = {k: np.array(v) for k, v in reference.items()}
    other["candidates"][slot, i] = max(other["candidates"][slot]) + 1
    assert "candidates" in failed(other)


def test_f32_tolerance_grows_with_the_values():
    """Float32 rounding is relative: features of magnitude 2.5e4 (SmolLM2's outlier
    dimension) differ by ulps of 0.002 between two correct implementations, which the
    order-1 tolerance alone would fail; a real error at that scale still fails."""
    from dspine_jax.parity import F32_RELATIVE, TOLERANCES, compare

    reference = unpack(golden("dspine"), 0)
    big = {**reference, "features": reference["features"] * 0 + 2.5e4}
    rounded = {**big, "features": big["features"] + 0.0156}
    wrong = {**big, "features": big["features"] + 2.5}          # 1e-4 of the values
    assert F32_RELATIVE * 2.5e4 > TOLERANCES["float32"]["features"]
    assert {r.stage: r.ok for r in compare(big, rounded)}["features"]
    assert not {r.stage: r.ok for r in compare(big, wrong)}["features"]


def test_q_tolerance_follows_the_measured_score_difference():
    """q = softmax(scores / T): scores apart by d move q by at most exp(2d/T) - 1, so q
    may differ by that much (the real SmolLM2 pair: scores 4.5e-5 apart, q 1.8e-5) and
    no more."""
    from dspine_jax.parity import compare

    reference = unpack(golden("dflash"), 0)
    d = 4.5e-5
    shifted = {**reference, "draft_logits": reference["draft_logits"] + d,
               "q": reference["q"] + 1.8e-5}
    assert {r.stage: r.ok for r in compare(reference, shifted, q_temperature=0.8)}["q"]
    assert not {r.stage: r.ok for r in compare(reference, shifted)}["q"]     # no T: 1e-5
    too_far = {**shifted, "q": reference["q"] + 2 * np.expm1(2 * d / 0.8)}
    assert not {r.stage: r.ok for r in compare(reference, too_far, q_temperature=0.8)}["q"]


def test_bf16_tolerance_is_the_two_noise_floors_plus_the_f32_tolerance():
    """bf16 is judged by each side's own bf16-vs-f32 distance (its noise floor), never a
    hand-set number: tolerance = floor_jax + floor_torch + the float32 tolerance."""
    from dspine_jax.parity import F32_RELATIVE, TOLERANCES, compare

    reference = unpack(golden("dspine"), 0)
    with pytest.raises(ValueError, match="noise floors"):
        compare(reference, reference, "bfloat16")
    floors = ({"draft_logits": 0.2, "tokens": 1.0}, {"draft_logits": 0.1, "tokens": 0.0})
    tokens = reference["tokens"].copy()
    tokens[-1] += 1
    drifted = {**reference, "draft_logits": reference["draft_logits"] + 0.29, "tokens": tokens}
    rows = {r.stage: r for r in compare(reference, drifted, "bfloat16", floors)}
    f32 = max(TOLERANCES["float32"]["draft_logits"],
              F32_RELATIVE * np.abs(reference["draft_logits"]).max())
    assert rows["draft_logits"].tolerance == pytest.approx(0.3 + f32)
    assert rows["draft_logits"].ok and rows["draft_logits"].floors == (0.2, 0.1)
    assert rows["tokens"].ok and rows["tokens"].value == 1 and rows["tokens"].tolerance == 1
    worse = {**drifted, "draft_logits": reference["draft_logits"] + 0.31}
    assert not {r.stage: r for r in compare(reference, worse, "bfloat16", floors)}[
        "draft_logits"].ok
    # A stage with no floor (one side lacks it) cannot pass.
    assert not {r.stage: r for r in compare(reference, drifted, "bfloat16", ({}, {}))}[
        "draft_logits"].ok


@pytest.fixture(scope="module")
def jax_records():
    """The JAX side's float32 and bf16 records of one prompt (the dspine fixture)."""
    from dspine_jax.checkpoints import load_target, resolve_dtype
    from dspine_jax.drafters.checkpoint import load_drafter as jax_load
    from dspine_jax.parity import jax_stages

    out = {}
    for dtype in ("f32", "bf16"):
        target = load_target(str(FIXTURES / "target"), dtype=dtype, with_tokenizer=False)
        drafter = jax_load(FIXTURES / "dspine", dtype=resolve_dtype(dtype))
        out[dtype] = jax_stages(target.model, drafter, PROMPTS[0], max_new_tokens=8,
                                q_temperature=Q_TEMPERATURE)
    return out


def torch_records(drafter_folder) -> dict:
    out = {}
    for dtype, tdtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        model = transformers.AutoModelForCausalLM.from_pretrained(FIXTURES / "target",
                                                                  dtype=tdtype).eval()
        out[dtype] = torch_stages(model, load_drafter(drafter_folder, dtype=tdtype),
                                  PROMPTS[0], max_new_tokens=8, q_temperature=Q_TEMPERATURE)
    return out


def test_bf16_parity_passes_and_a_perturbed_weight_fails_both_ways(tmp_path, jax_records):
    """The same weights pass in float32 (stated tolerances) and in bf16 (noise floors),
    although the two bf16 targets round differently. The PyTorch drafter with its final
    norm scaled by 1.25 (a change larger than bf16 rounding) fails in both."""
    from safetensors.torch import load_file, save_file

    from dspine_jax.parity import judge_bf16

    def verdicts(theirs):
        bf16, f32 = judge_bf16(jax_records["bf16"], theirs["bf16"], jax_records["f32"],
                               theirs["f32"])
        return {r.stage for r in bf16 if not r.ok}, {r.stage for r in f32 if not r.ok}

    same = torch_records(FIXTURES / "dspine")
    assert verdicts(same) == (set(), set())
    # The targets' bf16 features really differ (transformers rounds RoPE's cos/sin to
    # bf16, JAX does not): far past any float32 tolerance, within the floors.
    assert np.max(np.abs(jax_records["bf16"]["features"] - same["bf16"]["features"])) > 1e-2

    perturbed = tmp_path / "perturbed"
    shutil.copytree(FIXTURES / "dspine", perturbed)
    tensors = load_file(str(perturbed / "model.safetensors"))
    tensors["norm.weight"] = tensors["norm.weight"] * 1.25
    save_file(tensors, str(perturbed / "model.safetensors"))
    failed_bf16, failed_f32 = verdicts(torch_records(perturbed))
    assert "draft_logits" in failed_bf16 and "draft_logits" in failed_f32
    assert "features" not in failed_bf16 | failed_f32     # the target is untouched
