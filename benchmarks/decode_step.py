"""Decode step time of the target alone (autoregressive), next to its floor and transformers.

  python benchmarks/decode_step.py --target smollm2-135m-instruct --batch 1 8 --impl jax
  python benchmarks/decode_step.py --target preset:qwen3-8b --batch 1 32 --impl transformers
  python benchmarks/decode_step.py --target preset:qwen3-8b --batch 1 8 32 \\
      --context 1024 16384 --attention-backend pallas xla --steps-per-call 16

`preset:NAME` builds random weights with a published model's shapes (step time does not
depend on weight values). JAX: the compiled decode is timed directly, `--steps-per-call`
steps per host round trip, with a host sync after every call as generate() does.
transformers: step time = (time for N new tokens - time for N/2 + 1) / (N/2 - 1), so
prefill cancels out; each figure is the median of --repeats runs.
--context N times steps at a cache length of N without an N-token prefill: after
prefilling --prompt-len tokens, every row's cache length is set to N (the skipped
positions hold zeros; attention reads them as it would real keys, so the step time is
that of an N-token context). A preset's max_position_embeddings is raised to fit.
--attention-backend runs each listed backend of the JAX engine (pallas: the paged
attention kernel; xla: dense attention over the gathered pages).
The floor is the bytes one step must read (weights + the KV cache) over the copy
bandwidth measured in the same process.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
from datetime import date


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--impl", choices=["jax", "transformers"], default="jax")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--context", type=int, nargs="+", default=None,
                   help="jax: cache lengths to time steps at (default: --prompt-len)")
    p.add_argument("--capacity", type=int, nargs="+", default=None,
                   help="jax: positions of pages each row owns (>= what it uses); a step "
                        "that reads only the used length is flat in it")
    p.add_argument("--attention-backend", nargs="+", default=["auto"],
                   choices=["auto", "pallas", "xla"],
                   help="jax: attention backends to time side by side")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--steps-per-call", type=int, nargs="+", default=[1, 16],
                   help="jax: decode steps per host round trip (device-side loop)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="append JSON lines here")
    return p.parse_args()


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up (compilation, allocator)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_time(run, new_tokens: int, repeats: int) -> float:
    """Seconds per decode step from two lengths: prefill and set-up cancel out."""
    short = new_tokens // 2 + 1
    return (median_time(run(new_tokens), repeats) - median_time(run(short), repeats)) / (
        new_tokens - short)


# ----- JAX ----------------------------------------------------------------------------------
def jax_copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    import jax
    import jax.numpy as jnp

    n = (1 << 32) if jax.default_backend() != "cpu" else (1 << 28)
    x = jnp.ones((n // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    copy(x).block_until_ready()
    t = median_time(lambda: copy(x).block_until_ready(), 10)
    return 2 * n / t


def load_jax_target(name: str, dtype: str, min_positions: int = 0):
    """A built-in name, a path, or `preset:NAME` (random weights, published shapes; its
    max_position_embeddings raised to `min_positions` when lower)."""
    from dspine_jax.checkpoints import load_target, resolve_dtype
    from dspine_jax.config import PRESETS

    key = name.split(":", 1)[1] if name.startswith("preset:") else None
    if key in PRESETS and PRESETS[key].max_position_embeddings < min_positions:
        import dataclasses

        from flax import nnx

        from dspine_jax.target import TargetModel

        config = dataclasses.replace(PRESETS[key], max_position_embeddings=min_positions)
        jdtype = resolve_dtype(dtype)
        model = TargetModel(config, dtype=jdtype, rngs=nnx.Rngs(0))
        return model, config, model.dtype
    loaded = load_target(name, dtype=dtype, with_tokenizer=False)
    if loaded.config.max_position_embeddings < min_positions:
        raise SystemExit(f"{name} has a context of {loaded.config.max_position_embeddings}; "
                         f"--context needs {min_positions} (use a preset: shapes only)")
    return loaded.model, loaded.config, loaded.model.dtype


def with_context(state, context: int):
    """Every row's caches jump to `context` positions (see the module doc)."""
    import jax.numpy as jnp

    caches = tuple(c.replace(lengths=jnp.full_like(c.lengths, context)) for c in state.caches)
    return state.replace(caches=caches)


def bench_jax(args) -> list[dict]:
    import jax
    import numpy as np

    from dspine_jax.generate import AutoregressiveGenerator
    from dspine_jax.runtime.fixed_batch import FixedBatch

    contexts = args.context or [args.prompt_len]
    budget = 2 * max(2, args.new_tokens // min(args.steps_per_call)) * max(args.steps_per_call)
    model, config, dtype = load_jax_target(args.target, args.dtype,
                                           max(contexts + (args.capacity or [])) + budget + 2)
    bandwidth = jax_copy_bandwidth()
    results = []
    for backend, steps, context, b, capacity in itertools.product(
            args.attention_backend, args.steps_per_call, contexts, args.batch,
            args.capacity or [0]):
        calls = max(2, args.new_tokens // steps)
        # Budget past what we time, so no row finishes inside the timed calls; a larger
        # --capacity gives every row more pages than it will use.
        new_tokens = max(context - args.prompt_len + 2 * calls * steps + 2,
                         capacity - args.prompt_len)
        gen = AutoregressiveGenerator(
            model, eos_token_ids=[], steps_per_call=steps, attention_backend=backend,
            page_size=args.page_size)
        prompts = np.random.default_rng(0).integers(
            0, config.vocab_size, size=(b, args.prompt_len)).tolist()
        run = FixedBatch(gen, prompts, max_new_tokens=new_tokens, ignore_eos=True)

        def decode_calls():
            state = run.decode(with_context(run.prefill(), context))
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            for _ in range(calls):  # each call syncs with the host, as generate() does
                state = run.decode(state)
                jax.device_get(state.num_generated)
            return (time.perf_counter() - t0) / (calls * steps)

        decode_calls()  # warm-up
        step = statistics.median(decode_calls() for _ in range(args.repeats))
        floor = step_bytes(config, b, context + calls * steps,
                           np.dtype(dtype).itemsize) / bandwidth
        results.append(dict(impl="jax", attention_backend=gen.attention.name, context=context,
                            capacity=args.prompt_len + new_tokens, steps_per_call=steps,
                            batch=b, step_ms=step * 1e3,
                            floor_ms=floor * 1e3, tokens_per_s=b / step,
                            bandwidth_GBps=bandwidth / 1e9, device=str(jax.devices()[0])))
        print(json.dumps(results[-1]), flush=True)
    return results


def step_bytes(config, batch: int, context: int, itemsize: int) -> int:
    """Weights read once + the KV cache read once per decode step."""
    kv = 2 * config.num_hidden_layers * batch * context * config.num_key_value_heads * \
        config.head_dim * itemsize
    return config.num_params() * itemsize + kv


# ----- transformers --------------------------------------------------------------------------
def bench_transformers(args) -> list[dict]:
    import torch
    import transformers

    from dspine_jax.config import PRESETS

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.target.startswith("preset:"):
        config = PRESETS[args.target.split(":", 1)[1]]
        hf_config = transformers.AutoConfig.for_model(config.family, **{
            k: v for k, v in config.to_hf().items() if k not in ("architectures", "model_type")})
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    else:
        from dspine_jax.registry import resolve_target

        path = resolve_target(args.target)
        kw = dict(gguf_file=path.name) if path.suffix == ".gguf" else {}
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent if kw else path, dtype=dtype, **kw).to(device)
        config = None
    model.eval()
    x = torch.ones(1 << 30, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def copy():
        x.clone()
        sync()
    bandwidth = 2 * x.numel() * 4 / median_time(copy, 10)
    results = []
    for b in args.batch:
        ids = torch.randint(0, model.config.vocab_size, (b, args.prompt_len), device=device)

        def run(n):
            def go():
                with torch.no_grad():
                    model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                   pad_token_id=0)
                sync()
            return go
        step = step_time(run, args.new_tokens, args.repeats)
        results.append(dict(impl="transformers", attn=model.config._attn_implementation,
                            batch=b, step_ms=step * 1e3, tokens_per_s=b / step,
                            bandwidth_GBps=bandwidth / 1e9, device=device))
        print(json.dumps(results[-1]), flush=True)
    return results


def main():
    args = parse_args()
    results = bench_jax(args) if args.impl == "jax" else bench_transformers(args)
    meta = dict(target=args.target, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                date=str(date.today()), host=platform.node())
    if args.out:
        with open(args.out, "a") as f:
            for r in results:
                f.write(json.dumps({**meta, **r}) + "\n")


if __name__ == "__main__":
    main()
