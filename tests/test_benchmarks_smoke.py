"""benchmarks/jax_kernels.py on the CPU's tiny shape (D 64, V 512, r 16, m 8, K 5, C 4):
every op of torch_kernels.py gets a row with its byte count, the Pallas vocab_top_k
(interpreted) agrees with XLA's, and the ops it times compute what dspine_torch's
references compute on the same inputs (where the result is deterministic: T = 0; the
T > 0 draws use JAX keys on one side and given uniforms on the other)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspine_benchmarks import jax_kernels

TINY = jax_kernels.SHAPES["tiny"]


def test_the_cpu_run_times_every_op_of_torch_kernels(tmp_path):
    out = tmp_path / "jax_kernels.json"
    jax_kernels.main(["--device", "cpu", "--out", str(out)])
    report = json.loads(out.read_text())
    assert {"date", "device", "jax", "jaxlib", "copy_gbs"} <= report.keys()
    rows = {(r["op"], r["variant"], r["implementation"]): r for r in report["kernels"]}
    d, v, r, m, k, c = (TINY[x] for x in "dvrmkc")
    n = k - 1                                                  # batch 1
    # torch_kernels.py's byte formulas for the tiny shape, batch 1
    want = {("vocab_topk", "C=4", "xla"): v * d * 2 + n * d * 2 + n * c * 12,
            ("vocab_topk", "C=4", "pallas_gpu"): v * d * 2 + n * d * 2 + n * c * 12,
            ("transition", "C=4", "xla"): n * (c * d * 2 + d * 2 + c * m * 4 + c * c * 4)
            + d * m * 2,
            ("chain_walk", "T=0", "xla"): n * c * c * 4 // c + n * c * 8 * 2,
            ("chain_walk", "T=0.8", "xla"): n * c * c * 4 // c + n * c * 8 * 2,
            ("injection", "r=16,m=8", "xla"): 2 * (r * d + 3 * m * r + d * m) + 2 * k * d * 2,
            ("acceptance", "T=0", "xla"): k * v * 4,
            ("acceptance", "T=0.8", "xla"): k * v * 4}
    assert {key: row["bytes"] for key, row in rows.items()} == want
    assert all(row["shape"] == "tiny" and row["batch"] == 1 and row["us"] > 0
               for row in rows.values())
    pallas = rows[("vocab_topk", "C=4", "pallas_gpu")]
    assert pallas["ids_match"] == 1.0 and pallas["max_value_diff"] < 1e-3


def t(x, dtype=None):
    """A JAX array as a torch tensor (bf16 through float32: exact both ways)."""
    import torch

    arr = np.asarray(x.astype(np.float32) if x.dtype.name == "bfloat16" else x)
    out = torch.from_numpy(arr.copy())
    return out.to(dtype) if dtype is not None else out


def test_the_timed_ops_match_the_torch_references():
    torch = pytest.importorskip("torch")
    from dspine_torch.kernels import acceptance
    from dspine_torch.kernels.dspine_proposal import reference as chain_ref
    from dspine_torch.kernels.gated_injection import reference as inject_ref

    batch, bf16 = 2, torch.bfloat16
    cases, _ = jax_kernels.build_cases(TINY, batch, ("pallas_gpu", True), seed=1)
    by = {(case.op, case.variant, case.implementation): case for case in cases}

    def run(key):
        return by[key].fn(*by[key].args)

    (vx, ix), (vp, ip) = run(("vocab_topk", "C=4", "xla")), run(("vocab_topk", "C=4",
                                                                 "pallas_gpu"))
    np.testing.assert_array_equal(np.asarray(ip), np.asarray(ix))
    np.testing.assert_allclose(np.asarray(vp), np.asarray(vx), rtol=1e-5, atol=1e-5)
    hidden, lm_head = by[("vocab_topk", "C=4", "xla")].args
    _, ids_t = chain_ref.vocab_topk(t(hidden, bf16), t(lm_head, bf16), TINY["c"])
    np.testing.assert_array_equal(np.asarray(ix), ids_t.numpy())

    pre, preds, ids, _, w = by[("transition", "C=4", "xla")].args
    head = chain_ref.ChainHead(
        readout=t(w.readout, bf16), receiver_gate=t(w.receiver_gate, bf16),
        predecessor_gate=t(w.predecessor_gate, bf16), bias=t(w.bias, bf16),
        message=t(w.message, bf16), write=t(w.write, bf16), norm_weight=t(w.norm_weight, bf16),
        eps=jax_kernels.EPS, whiten=t(w.transfer_whiten), mean=t(w.transfer_mean))
    gu = chain_ref.gated_messages(head, t(pre, bf16), t(preds).long(), t(lm_head, bf16))
    want = chain_ref.transition_table(head, t(pre, bf16), gu, t(ids).long(), t(lm_head, bf16))
    got = np.asarray(run(("transition", "C=4", "xla")))
    np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=2e-2 * float(want.abs().max()))

    table, cands = by[("chain_walk", "T=0", "xla")].args[:2]
    tokens, q, choice = run(("chain_walk", "T=0", "xla"))
    want_tokens, want_q, want_index = chain_ref.chain_walk(
        t(table), t(cands).long(), 0.0, 1.0, 0, torch.zeros(table.shape[:2]))
    np.testing.assert_array_equal(np.asarray(choice), want_index.numpy())
    np.testing.assert_array_equal(np.asarray(tokens), want_tokens.numpy())
    np.testing.assert_array_equal(np.asarray(q), want_q.numpy())

    _, h, code = by[("injection", "r=16,m=8", "xla")].args
    out, gate = run(("injection", "r=16,m=8", "xla"))
    want_out, want_gate = inject_ref.inject(
        t(h, bf16), t(code), head.readout, head.receiver_gate, head.predecessor_gate,
        head.bias, head.message, head.write)
    np.testing.assert_allclose(np.asarray(gate), want_gate.numpy(), atol=1e-2)
    np.testing.assert_allclose(np.asarray(out.astype(np.float32)), want_out.float().numpy(),
                               rtol=0, atol=2e-2 * float(want_out.float().abs().max()))

    logits, draft = by[("acceptance", "T=0", "xla")].args[:2]
    num_accepted, next_token = run(("acceptance", "T=0", "xla"))
    kept, nxt = acceptance.accept(t(logits), t(draft).long(), None, None, 0.0)
    np.testing.assert_array_equal(np.asarray(num_accepted), kept.numpy())
    np.testing.assert_array_equal(np.asarray(next_token), nxt.numpy())
    # the block is rejected where the benchmark perturbed the draft (slot K // 2)
    assert (kept.numpy() <= TINY["k"] // 2).all()


def test_loss_kernels_cpu_run_times_every_variant_and_they_agree(tmp_path):
    """benchmarks/loss_kernels.py on the CPU's tiny shape: a forward and a forward +
    backward row for the dense logits, each xla chunk size and the interpreted Pallas
    forward, all giving the dense CE."""
    from dspine_benchmarks import loss_kernels

    out = tmp_path / "loss.jsonl"
    loss_kernels.main(["--chunks", "1024", "--iters", "1", "--repeats", "1", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["variant"], r["backward"]) for r in rows} == {
        (v, b) for v in ("dense", "xla:1024", "pallas_gpu") for b in (False, True)}
    assert all(r["shape"] == "tiny" and r["us"] > 0 and r["rel_diff"] < 1e-5 for r in rows)


def test_verify_gemms_products_and_rows(tmp_path):
    """benchmarks/verify_gemms.py: the fused projections of Qwen3-8B's layer, every path's
    product against float64 numpy, and one JSON row per product, rows and path."""
    import jax
    import jax.numpy as jnp

    from dspine_benchmarks import verify_gemms
    from dspine_jax.config import PRESETS

    assert verify_gemms.projections(PRESETS["qwen3-8b"]) == [
        ("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096),
        ("down", 4096, 12288), ("lm_head", 151936, 4096)]
    x = jax.random.normal(jax.random.key(0), (5, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (24, 64), jnp.float32)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    for path in ("xla", "split-k2", "split-k4"):
        got = np.asarray(verify_gemms.product(path)(x, w), np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=path)

    out = tmp_path / "gemms.jsonl"
    verify_gemms.main(["--target", "preset:smollm2-135m", "--rows", "2", "--only", "o",
                       "--paths", "xla", "split-k2", "--layers", "2", "--repeats", "1",
                       "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["product"], r["rows"], r["path"]) for r in rows] == [
        ("o", 2, "xla"), ("o", 2, "split-k2")]
    assert all(r["us"] > 0 and r["relative_error"] < 2e-2 for r in rows)
    with pytest.raises(SystemExit, match="split-kS"):
        verify_gemms.main(["--paths", "split-kx"])
