"""dspine_torch.kernels: every Triton kernel against its PyTorch reference, and the
references against the drafter code and against p.

One test body per op runs for each implementation. Without CUDA the Triton kernels run
under Triton's interpreter (TRITON_INTERPRET=1, set here before any kernel module is
imported); with CUDA they compile. Tolerances by dtype: float32 ~1e-5 relative, bf16
~2e-2 of the output's scale. Tests marked `gpu` use Qwen3-8B shapes and need CUDA.

Fresh random inputs per case; ids are compared exactly where the reference's values
are separated by more than the tolerance (a near-tie may order differently).
"""

from __future__ import annotations

import inspect
import math
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # before triton is imported: its knobs read the variable once
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="the Triton kernels need the triton package")
DEVICE = "cuda" if CUDA else "cpu"

from dspine_torch.kernels import acceptance, dspine_proposal, gated_injection  # noqa: E402
from dspine_torch.kernels.acceptance import reference as accept_ref  # noqa: E402
from dspine_torch.kernels.common import inverse_cdf, warp_logits  # noqa: E402
from dspine_torch.kernels.dspine_proposal import ChainHead  # noqa: E402

# The interpreter evaluates both sides of tl.where: -inf - -inf in masked lanes.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
DTYPES = [torch.float32, torch.bfloat16]
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def close(got: torch.Tensor, want: torch.Tensor, dtype, reduction: int = 1):
    """Max abs difference within the dtype's tolerance of the output's scale, scaled by
    sqrt(reduction length) / sqrt(64) past 64 terms."""
    scale = float(want.float().abs().max()) or 1.0
    tol = RTOL[dtype] * scale * max(1.0, math.sqrt(reduction / 64))
    diff = float((got.float() - want.float()).abs().max())
    assert diff <= tol, f"max abs difference {diff:.3g} > {tol:.3g} (scale {scale:.3g})"


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, g, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


def random_head(d: int, r: int, m: int, v: int, g, dtype, table: bool = False) -> ChainHead:
    whiten, mean, codes = None, None, None
    if table:
        codes = torch.nn.functional.normalize(torch.randn(v, r, generator=g), dim=-1)
        codes = codes.to(DEVICE)
    else:
        whiten, mean = randn(d, r, g=g, scale=0.3), randn(d, g=g, scale=0.05)
    return ChainHead(readout=randn(r, d, g=g, dtype=dtype, scale=0.2),
                     receiver_gate=randn(m, r, g=g, dtype=dtype, scale=0.2),
                     predecessor_gate=randn(m, r, g=g, dtype=dtype, scale=0.2),
                     bias=randn(m, g=g, dtype=dtype), message=randn(m, r, g=g, dtype=dtype,
                                                                     scale=0.2),
                     write=randn(d, m, g=g, dtype=dtype, scale=0.2),
                     norm_weight=(1 + randn(d, g=g, scale=0.1)).to(dtype), eps=1e-6,
                     whiten=whiten, mean=mean, code_table=codes)


# ----- the warp and the draw ------------------------------------------------------------------
def test_kernel_warp_is_the_drafters_warp():
    from dspine_torch.modeling_dspine import warp_logits as library_warp

    logits = torch.randn(6, 50, generator=gen(0)) * 3
    for t, p, k in [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 7), (0.5, 0.3, 20)]:
        assert torch.equal(warp_logits(logits, t, p, k), library_warp(logits, t, p, k))


def test_inverse_cdf_never_draws_a_zero_weight_entry():
    weights = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([0.0, 0.49, 0.5, 0.999999])
    assert inverse_cdf(weights, u).tolist() == [1, 1, 3, 3]


# ----- the proposal -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,d,v,c", [(15, 64, 300, 8), (4, 48, 96, 4), (33, 32, 257, 16)])
def test_vocab_topk(dtype, n, d, v, c):
    g = gen(n + v)
    hidden, lm_head = randn(n, d, g=g, dtype=dtype), randn(v, d, g=g, dtype=dtype)
    want_v, want_i = dspine_proposal.vocab_topk(hidden, lm_head, c)
    got_v, got_i = dspine_proposal.vocab_topk(hidden, lm_head, c, implementation="triton")
    close(got_v, want_v, dtype, d)
    full = hidden.float() @ lm_head.float().T
    # the chosen ids carry the values reported, and are the top C up to near-ties
    close(full.gather(1, got_i), want_v, dtype, d)
    gap = (want_v[:, :-1] - want_v[:, 1:]).min(-1).values
    clear = gap > 1e-3 * want_v.abs().max()
    assert torch.equal(got_i[clear], want_i[clear])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table", [False, True])
def test_transition_table(dtype, table):
    g = gen(7)
    n, d, v, r, m, c = 12, 64, 120, 16, 8, 8
    head = random_head(d, r, m, v, g, dtype, table=table)
    lm_head = randn(v, d, g=g, dtype=dtype)
    pre = randn(n, d, g=g, dtype=dtype, scale=3.0)
    preds = torch.randint(0, v, (n, c), generator=g).to(DEVICE)
    cands = torch.stack([torch.randperm(v, generator=g)[:c] for _ in range(n)]).to(DEVICE)
    gu = dspine_proposal.gated_messages(head, pre, preds, lm_head)
    want = dspine_proposal.transition_table(head, pre, gu, cands, lm_head)
    got = dspine_proposal.transition_table(head, pre, gu, cands, lm_head,
                                           implementation="triton")
    close(got, want, dtype, d)


WARPS = [(0.0, 1.0, 0), (1.0, 1.0, 0), (0.7, 0.8, 0), (1.3, 1.0, 3), (0.6, 0.5, 5)]


@pytest.mark.parametrize("temperature,top_p,top_k", WARPS)
@pytest.mark.parametrize("c", [4, 16, 5])
def test_chain_walk(temperature, top_p, top_k, c):
    g = gen(c)
    b, s = 3, 7
    table = randn(b, s, c, c, g=g, scale=2.0)
    cands = torch.randint(0, 1000, (b, s, c), generator=g).to(DEVICE)
    u = torch.rand(b, s, generator=g).to(DEVICE)
    want = dspine_proposal.chain_walk(table, cands, temperature, top_p, top_k, u)
    got = dspine_proposal.chain_walk(table, cands, temperature, top_p, top_k, u,
                                     implementation="triton")
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    close(got[1], want[1], torch.float32)
    # q is a distribution over the candidates, with the drawn candidate in its support
    torch.testing.assert_close(got[1].sum(-1), torch.ones(b, s, device=DEVICE))
    assert (got[1].gather(-1, got[2][..., None]) > 0).all()


@pytest.mark.parametrize("implementation", ["torch", "triton"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_propose_chain_end_to_end(implementation, temperature):
    g = gen(11)
    b, s, d, v, r, m, c = 2, 4, 32, 96, 16, 8, 4
    head = random_head(d, r, m, v, g, torch.float32)
    lm_head = randn(v, d, g=g)
    hidden, pre = randn(b, s, d, g=g), randn(b, s, d, g=g)
    anchor = torch.tensor([3, 50], device=DEVICE)
    u = torch.rand(b, s, generator=g).to(DEVICE)
    ref = dspine_proposal.propose_chain(hidden, pre, anchor, lm_head, head, c, temperature,
                                        0.9, 0, u)
    got = dspine_proposal.propose_chain(hidden, pre, anchor, lm_head, head, c, temperature,
                                        0.9, 0, u, implementation=implementation)
    assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.candidates, ref.candidates)
    close(got.table, ref.table, torch.float32, d)
    assert torch.equal(got.tokens, got.candidates.gather(-1, got.index[..., None])[..., 0])


# ----- the injection --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,k,d,r,m", [(2, 5, 64, 16, 8), (1, 16, 96, 24, 12), (3, 3, 32, 16, 16)])
def test_gated_injection(dtype, b, k, d, r, m):
    g = gen(b * k + d)
    h = randn(b, k, d, g=g, dtype=dtype, scale=2.0)
    code = randn(b, r, g=g)
    weights = [randn(r, d, g=g, dtype=dtype, scale=0.1), randn(m, r, g=g, dtype=dtype, scale=0.2),
               randn(m, r, g=g, dtype=dtype, scale=0.2), randn(m, g=g, dtype=dtype),
               randn(m, r, g=g, dtype=dtype, scale=0.2), randn(d, m, g=g, dtype=dtype, scale=0.2)]
    want_h, want_g = gated_injection.inject(h, code, *weights)
    got_h, got_g = gated_injection.inject(h, code, *weights, implementation="triton")
    close(got_h - h, want_h - h, dtype, m) if dtype == torch.float32 else close(got_h, want_h,
                                                                                dtype, m)
    close(got_g, want_g, dtype if dtype == torch.float32 else torch.bfloat16, r)
    assert torch.equal(got_h[:, 0], h[:, 0])          # the anchor slot gets no write


# ----- acceptance -----------------------------------------------------------------------------
def _block(g, b=3, k=5, v=300, c=8, copy_target=True):
    logits = randn(b, k, v, g=g, scale=3.0)
    draft = logits[:, :-1].argmax(-1) if copy_target else torch.randint(0, v, (b, k - 1),
                                                                        generator=g).to(DEVICE)
    draft[1, 2] = (draft[1, 2] + 1) % v                 # row 1 is rejected at slot 2
    ids = torch.stack([torch.randperm(v, generator=g)[:c] for _ in range(b * (k - 1))])
    ids = ids.reshape(b, k - 1, c).to(DEVICE)
    ids[..., 0] = draft
    probs = torch.softmax(randn(b, k - 1, c, g=g), -1)
    return logits, draft, ids, probs


@pytest.mark.parametrize("temperature,top_p,top_k", WARPS)
@pytest.mark.parametrize("sparse", [True, False])
def test_acceptance(temperature, top_p, top_k, sparse):
    g = gen(int(temperature * 10) + top_k)
    for trial in range(3):
        logits, draft, ids, probs = _block(g, copy_target=trial != 2)
        q = (ids, probs) if sparse else (None, accept_ref.dense_q(ids, probs, logits.shape[-1]))
        u_a, u_n = torch.rand(3, 4, generator=g).to(DEVICE), torch.rand(3, generator=g).to(DEVICE)
        want = acceptance.accept(logits, draft, *q, temperature, top_p, top_k, u_a, u_n)
        got = acceptance.accept(logits, draft, *q, temperature, top_p, top_k, u_a, u_n,
                                implementation="triton")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (got, want)
        if temperature == 0:
            assert want[0].tolist()[1] == 2 or trial == 2


def test_acceptance_at_t0_is_the_argmax_prefix():
    g = gen(5)
    logits, draft, ids, probs = _block(g)
    n, nxt = acceptance.accept(logits, draft, None, None, 0.0)
    assert n.tolist() == [4, 2, 4]
    assert nxt.tolist() == [int(logits[0, 4].argmax()), int(logits[1, 2].argmax()),
                            int(logits[2, 4].argmax())]


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_acceptance_with_sparse_q_follows_p(top_p):
    """One slot drafted from sparse q over 3 of 6 tokens, then the rule: the emitted token
    (the draft if kept, else the residual's draw) is distributed as p. 40k rows at once."""
    rows = 40000
    g = gen(1)
    logits = torch.tensor([[1.0, 0.5, 0.2, -0.3, 0.8, 0.0], [0.0] * 6])
    p = torch.softmax(warp_logits(logits[0], 1.0, top_p), -1)
    ids = torch.tensor([1, 4, 5])
    q_c = torch.tensor([0.6, 0.3, 0.1])
    draws = torch.multinomial(q_c, rows, replacement=True, generator=g)
    draft = ids[draws][:, None]
    n, nxt = accept_ref.accept(logits.expand(rows, -1, -1), draft, ids.expand(rows, 1, 3),
                               q_c.expand(rows, 1, 3), 1.0, top_p, 0,
                               torch.rand(rows, 1, generator=g), torch.rand(rows, generator=g))
    emitted = torch.where(n == 1, draft[:, 0], nxt)
    freq = torch.bincount(emitted, minlength=6).double() / rows
    sigma = (p * (1 - p) / rows).sqrt().double()
    assert ((freq - p.double()).abs() <= 4 * sigma + 1e-12).all(), (freq, p)


# ----- the drafter and the loop ------------------------------------------------------------------
@pytest.fixture(scope="module")
def fixtures():
    pytest.importorskip("transformers")
    from tests.torch_port_golden import FIXTURES

    return FIXTURES


def test_references_are_the_drafters_own_head_and_write(fixtures):
    """The kernels' references compute what DSpineDraftModel computes (its forward with
    and without the injection hook; its propose at T = 0)."""
    from dspine_torch import load_drafter
    from dspine_torch.speculative import chain_head, injector

    drafter = load_drafter(fixtures / "dspine")
    g = gen(0)
    v, d = drafter.config.vocab_size, drafter.config.hidden_size
    e_in, e_out = torch.randn(v, d, generator=g), torch.randn(v, d, generator=g)
    features = torch.randn(1, 6, 2 * d, generator=g)
    context = drafter.extend_context(drafter.new_context(), features)
    anchor = torch.tensor([7])
    with torch.no_grad():
        plain = drafter(anchor, context, e_in, e_out)
        hooked = drafter(anchor, context, e_in, e_out, inject=injector(drafter, "torch"))
        torch.testing.assert_close(hooked.logits, plain.logits, atol=1e-6, rtol=0)
        torch.testing.assert_close(hooked.gates, plain.gates, atol=1e-7, rtol=0)
        theirs = drafter.propose(plain, anchor, e_out)
        ours = dspine_proposal.propose_chain(plain.hidden[:, 1:], plain.pre_injection[:, 1:],
                                             anchor, e_out, chain_head(drafter),
                                             drafter.config.top_k)
    assert torch.equal(ours.tokens, theirs.tokens)
    assert torch.equal(ours.candidates, theirs.candidates)
    torch.testing.assert_close(ours.table, theirs.table, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def target(fixtures):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        fixtures / "target", dtype=torch.float32).eval().to(DEVICE)


@pytest.mark.parametrize("kind", ["dflash", "dspine"])
def test_loop_with_triton_kernels_is_the_torch_loop(fixtures, target, kind):
    """T = 0: the target's greedy tokens, as the torch loop; T > 0: the same draws."""
    from dspine_torch import load_drafter
    from dspine_torch.speculative import Sampling, generate
    from tests.torch_port_golden import PROMPTS

    drafter = load_drafter(fixtures / kind).to(DEVICE)
    for sampling in (Sampling(), Sampling(temperature=0.9, top_p=0.9, top_k=20)):
        runs = [generate(target, drafter, PROMPTS[1], max_new_tokens=12, sampling=sampling,
                         seed=3, ignore_eos=True, implementation=impl)
                for impl in ("torch", "triton")]
        assert runs[0] == runs[1]
    with torch.no_grad():
        greedy = target.generate(torch.tensor([PROMPTS[1]], device=DEVICE), max_new_tokens=12,
                                 min_new_tokens=12, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
    assert runs[0].tokens != [] and generate(
        target, drafter, PROMPTS[1], max_new_tokens=12, ignore_eos=True,
        implementation="triton").tokens == greedy[0, len(PROMPTS[1]):].tolist()


def test_bad_implementation_is_refused():
    with pytest.raises(ValueError, match="implementation must be one of"):
        acceptance.accept(torch.zeros(1, 2, 4), torch.zeros(1, 1, dtype=torch.long), None, None,
                          implementation="cuda")


# ----- the compiler's front end for sm_90, on the CPU ---------------------------------------------
# The interpreter runs a kernel as Python and accepts code Triton's compiler refuses (a name
# re-bound from a scalar to a tile inside a loop, say). So every kernel these tests launch is
# also lowered to Triton IR for Hopper, from the same arguments: no GPU is needed for that.
_POINTER = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16",
            torch.int32: "*i32", torch.int64: "*i64", torch.bool: "*i1"}


def _signature(fn, args, kwargs):
    """The (signature, constexprs) a compiled launch of `fn` with these arguments gets."""
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args), **kwargs)
    signature, constexprs = {}, {}
    for name, param in params.items():
        value = bound[name]
        if "constexpr" in str(param.annotation):
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = _POINTER[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        else:
            signature[name] = "fp32"
    return signature, constexprs


_LOWER = """
import importlib, json, sys
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
import triton._C.libtriton as libtriton
target = GPUTarget("cuda", 90, 32)
backend = CUDABackend(target)
options = backend.parse_options({})
context = libtriton.ir.context()
libtriton.ir.load_dialects(context)
backend.load_dialects(context)
for module, name, signature, constexprs in json.load(sys.stdin):
    fn = getattr(importlib.import_module(module), name)
    ASTSource(fn=fn, signature=signature, constexprs=constexprs).make_ir(
        target, options, backend.get_codegen_implementation(options),
        backend.get_module_map(), context)
    print("lowered", name, constexprs)
"""


def test_every_kernel_lowers_for_hopper(monkeypatch):
    import json
    import subprocess
    import sys

    from triton.runtime.interpreter import InterpretedFunction

    launches = {}
    run = InterpretedFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        signature, constexprs = _signature(self.fn, args, kwargs)
        launches[(self.fn.__name__, repr(sorted(constexprs.items())))] = (
            self.fn.__module__, self.fn.__name__, signature, constexprs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", record)
    for sparse in (True, False):
        for warp in WARPS[:3]:
            test_acceptance(*warp, sparse)
    test_vocab_topk(torch.bfloat16, 15, 64, 300, 8)
    test_transition_table(torch.bfloat16, True)
    test_chain_walk(0.7, 0.8, 0, 5)
    test_chain_walk(0.0, 1.0, 0, 4)
    test_gated_injection(torch.bfloat16, 2, 5, 64, 16, 8)
    assert {name for name, _ in launches} == {
        "_row_stats", "_accept", "_tile_topk", "_transition", "_chain_walk", "_inject"}
    # A fresh process: the interpreter patches triton.language in this one.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _LOWER], input=json.dumps(list(
        launches.values())), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("lowered") == len(launches)


# ----- GPU: Qwen3-8B shapes, compiled ---------------------------------------------------------
QWEN3_8B = dict(d=4096, v=151936, r=512, m=256, k=16, c=16)


def _needs_cuda():
    if not CUDA:
        pytest.skip("needs a CUDA GPU (compiled Triton kernels at Qwen3-8B shapes)")


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_gpu_proposal_at_qwen3_8b_shapes(batch):
    _needs_cuda()
    s = QWEN3_8B
    g = gen(batch)
    dtype = torch.bfloat16
    n = batch * (s["k"] - 1)
    hidden = randn(n, s["d"], g=g, dtype=dtype)
    lm_head = randn(s["v"], s["d"], g=g, dtype=dtype, scale=0.02)
    want_v, want_i = dspine_proposal.vocab_topk(hidden, lm_head, s["c"])
    got_v, got_i = dspine_proposal.vocab_topk(hidden, lm_head, s["c"], implementation="triton")
    close(got_v, want_v, torch.float32, s["d"])  # bf16 inputs, float32 sums over D
    assert (got_i == want_i).float().mean() > 0.99
    head = random_head(s["d"], s["r"], s["m"], s["v"], g, dtype)
    preds = want_i.reshape(batch, -1, s["c"])
    gu = dspine_proposal.gated_messages(head, hidden, want_i, lm_head)
    want = dspine_proposal.transition_table(head, hidden, gu, want_i, lm_head)
    got = dspine_proposal.transition_table(head, hidden, gu, want_i, lm_head,
                                           implementation="triton")
    close(got, want, dtype, 64)
    table = want.reshape(batch, -1, s["c"], s["c"])
    u = torch.rand(batch, s["k"] - 1, generator=g).to(DEVICE)
    for t, p, k in WARPS:
        a = dspine_proposal.chain_walk(table, preds, t, p, k, u)
        b = dspine_proposal.chain_walk(table, preds, t, p, k, u, implementation="triton")
        assert torch.equal(a[0], b[0])


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_gpu_injection_at_qwen3_8b_shapes(batch):
    _needs_cuda()
    s, dtype, g = QWEN3_8B, torch.bfloat16, gen(batch + 1)
    h = randn(batch, s["k"], s["d"], g=g, dtype=dtype)
    code = randn(batch, s["r"], g=g)
    r, m, d = s["r"], s["m"], s["d"]
    weights = [randn(r, d, g=g, dtype=dtype, scale=0.02), randn(m, r, g=g, dtype=dtype, scale=0.05),
               randn(m, r, g=g, dtype=dtype, scale=0.05), randn(m, g=g, dtype=dtype),
               randn(m, r, g=g, dtype=dtype, scale=0.05), randn(d, m, g=g, dtype=dtype,
                                                                scale=0.05)]
    want = gated_injection.inject(h, code, *weights)
    got = gated_injection.inject(h, code, *weights, implementation="triton")
    close(got[0], want[0], dtype, 64)
    close(got[1], want[1], dtype, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature,top_p,top_k", WARPS)
def test_gpu_acceptance_at_qwen3_8b_vocab(temperature, top_p, top_k):
    _needs_cuda()
    g = gen(17)
    logits, draft, ids, probs = _block(g, b=8, k=16, v=QWEN3_8B["v"], c=16)
    u_a, u_n = torch.rand(8, 15, generator=g).to(DEVICE), torch.rand(8, generator=g).to(DEVICE)
    want = acceptance.accept(logits, draft, ids, probs, temperature, top_p, top_k, u_a, u_n)
    got = acceptance.accept(logits, draft, ids, probs, temperature, top_p, top_k, u_a, u_n,
                            implementation="triton")
    assert torch.equal(got[0], want[0])
    assert (got[1] == want[1]).float().mean() >= 7 / 8   # a draw may sit on a rounding edge


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dflash", "dspine"])
def test_gpu_batched_loop_with_triton_kernels(fixtures, target, kind):
    """Batch 8 of ragged prompts on the GPU through the Triton kernels: at T = 0 every row
    is transformers' greedy decoding of its prompt alone; at T > 0 the torch loop's
    tokens, row by row, for most rows (a draw may sit on a rounding edge)."""
    _needs_cuda()
    from dspine_torch import load_drafter
    from dspine_torch.speculative import Sampling, generate_batch
    from tests.torch_port_golden import PROMPTS

    drafter = load_drafter(fixtures / kind).to(DEVICE)
    prompts = [p[:len(p) - i] for i in range(3) for p in PROMPTS][:8]
    gens = generate_batch(target, drafter, prompts, max_new_tokens=24, ignore_eos=True,
                          implementation="triton")
    for prompt, gen in zip(prompts, gens):
        with torch.no_grad():
            ref = target.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=24,
                                  min_new_tokens=24, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
        assert gen.tokens == ref[0, len(prompt):].tolist()
    sampling = Sampling(temperature=0.9, top_p=0.9, top_k=20)
    runs = [generate_batch(target, drafter, prompts, max_new_tokens=16, sampling=sampling,
                           seed=3, ignore_eos=True, implementation=impl)
            for impl in ("torch", "triton")]
    assert sum(a == b for a, b in zip(*runs)) >= 6
