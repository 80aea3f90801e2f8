"""Where a decoding step spends its time: a jax.profiler trace of compiled AR steps and
speculative passes, summarised as a roofline table of op groups and the top operations
by time per pass.

  python -m dspine_benchmarks.profile_step --target preset:qwen3-8b --methods ar dspine \\
      --batch 1 --context 1024 --attention-backend pallas --out profile.json

For each method it prefills random prompts, runs the compiled decode loop once to warm up,
then traces `--calls` host calls (`--steps-per-call` passes each) and reads the Perfetto
trace JAX writes: device kernels on a GPU, XLA's per-op events on a CPU. Operations are
grouped by name (fusions keep XLA's names, kernels their own), summed, divided by the
number of passes, and listed with their share of the traced device time and the JAX
operation each runs (from the optimised HLO of the compiled programs, `hlo_names`). The
roofline table (`roofline`) sums them by op group (attention, the QKV/O/MLP GEMMs, norms,
lm_head, the draft layers, the proposal, acceptance, sampling) with each group's bytes
and FLOPs from the same HLO, and its achieved share of the copy bandwidth and matmul
rate measured at the start of the run. The trace folder stays in `--trace-dir` for
Perfetto or TensorBoard. In a CUDA graph (XLA's default on a GPU) a cuBLAS kernel's event
names the graph, not its GEMM: `roofline.resolve_kernel_names` places what the schedule
allows and groups the rest as `gemm`; `--no-cuda-graphs` traces without the graphs, so
each GEMM is named.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import tempfile
from pathlib import Path

import jax
import numpy as np

from dspine_benchmarks import hlo_names, roofline
from dspine_benchmarks.decode_step import load_jax_target, with_context
from dspine_benchmarks.spec_step import add_step_args, make_decoder, sampling_options


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    add_step_args(p, sweep=False, methods=("ar", "dspine"))
    p.add_argument("--top", type=int, default=15, help="operations listed per method")
    p.add_argument("--trace-dir", default=None, help="keep the traces here (default: temp)")
    p.add_argument("--hlo-out", default=None,
                   help="write each method's optimised decode HLO here (METHOD.hlo.txt.gz), "
                        "to read its kernels' instructions later")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="trace with XLA's command buffers (CUDA graphs) off: a cuBLAS "
                        "kernel's event then names its own custom call, so every GEMM "
                        "lands in its group (kernel times are the same; the gaps between "
                        "them are not)")
    p.add_argument("--out", default=None, help="write the summary as JSON")
    return p.parse_args(argv)


# XLA's flag for which ops run in command buffers; empty: none.
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="


def without_cuda_graphs(environ) -> None:
    """Add NO_COMMAND_BUFFERS to XLA_FLAGS in `environ`; read when JAX starts its GPU
    backend, so before this process's first JAX computation."""
    flags = environ.get("XLA_FLAGS", "").split()
    if NO_COMMAND_BUFFERS not in flags:
        environ["XLA_FLAGS"] = " ".join(flags + [NO_COMMAND_BUFFERS])


def device_events(trace: dict) -> list[dict]:
    """Complete events that ran on a device: a GPU's stream tracks where the trace has
    them, else XLA's op events of a CPU run (named after HLO ops, not Python frames)."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if "/device:GPU" in names.get(e["pid"], "")]
    if gpu:
        return gpu
    return [e for e in events if "hlo_op" in e.get("args", {})
            or "long_name" in e.get("args", {})]


def summarise(events: list[dict], passes: int, top: int,
              op_names: dict[str, str] | None = None) -> dict:
    """Device time per pass, and the `top` operations; op_names (`hlo_names`) adds the
    JAX operation each kernel runs, where the HLO names it."""
    per_op = collections.Counter()
    for e in events:
        per_op[e["name"]] += e["dur"]  # microseconds
    total = sum(per_op.values())
    rows = [{"op": name, "us_per_pass": us / passes, "share": us / max(total, 1e-9)}
            for name, us in per_op.most_common(top)]
    for row in rows:
        if op_names and row["op"] in op_names:
            row["op_name"] = op_names[row["op"]]
    return {"device_us_per_pass": total / passes, "top": rows}


def top_table(rows: list[dict]) -> str:
    """`summarise`'s top operations, one line each, with the JAX operation where known."""
    lines = [f"{'us/pass':>9} {'share':>6}  {'op':<48}  JAX operation"]
    lines += [f"{row['us_per_pass']:9.1f} {row['share']:6.1%}  {row['op'][:48]:<48}  "
              f"{row.get('op_name', '')[-90:]}" for row in rows]
    return "\n".join(lines)


def profile(method: str, model, config, args, trace_dir: Path, peaks: dict) -> dict:
    from dspine_jax.runtime import slot_steps
    from dspine_jax.runtime.fixed_batch import FixedBatch

    context = args.context or args.prompt_len
    passes = args.calls * args.steps_per_call
    new_tokens = context - args.prompt_len + 4 * (args.calls + 2) * args.steps_per_call
    decoder, _ = make_decoder(method, model, config, args, args.attention_backend,
                              proposal=args.proposal, layers=args.layer_kernels)
    prompts = np.random.default_rng(0).integers(0, config.vocab_size,
                                                size=(args.batch, args.prompt_len)).tolist()
    run = FixedBatch(decoder, prompts, max_new_tokens=new_tokens, ignore_eos=True,
                     **sampling_options(args, args.temperature))
    state = run.decode(with_context(run.prefill(), context))  # compiled and warm
    jax.block_until_ready(state)
    folder = trace_dir / method
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        for _ in range(args.calls):
            state = run.decode(state)
            jax.device_get(state.num_generated)
    [path] = sorted(folder.rglob("*.trace.json.gz"))[-1:]
    with gzip.open(path) as f:
        trace = json.load(f)
    # the decode programs XLA compiled, as optimised HLO: op names, bytes and FLOPs
    texts = slot_steps.compiled(decoder).hlo_texts("decode")
    if args.hlo_out:
        Path(args.hlo_out).mkdir(parents=True, exist_ok=True)
        with gzip.open(Path(args.hlo_out) / f"{method}.hlo.txt.gz", "wt") as f:
            f.write("\n\n".join(texts))
    names, costs = {}, {}
    for text in texts:
        names.update(hlo_names.op_names(text))
        costs.update(roofline.hlo_costs(text))
    events = roofline.resolve_kernel_names(device_events(trace), set(names) | set(costs),
                                           roofline.hlo_schedule(texts), passes)
    summary = summarise(events, passes, args.top, names)
    # the target's attention must read its KV cache over the context, not the whole pools
    q_len = 1 if method == "ar" else args.block_size
    kv_bytes = (config.num_hidden_layers * args.batch * (context + q_len) * 2
                * config.num_key_value_heads * config.head_dim * np.dtype(decoder.dtype).itemsize)
    groups = roofline.group_rows(events, passes, names, costs, peaks,
                                 bytes_override={"attention": float(kv_bytes)})
    return {"method": method, "attention_backend": decoder.attention.name,
            "layer_kernels": args.layer_kernels, "batch": args.batch,
            "context": context, "temperature": args.temperature, "passes": passes,
            "trace": str(path.relative_to(trace_dir)), **summary, "groups": groups}


def main(argv=None):
    args = parse_args(argv)
    if args.no_cuda_graphs:
        without_cuda_graphs(os.environ)
    context = args.context or args.prompt_len
    positions = context + 4 * (args.calls + 2) * args.steps_per_call + args.block_size
    trace_dir = Path(args.trace_dir or tempfile.mkdtemp(prefix="dspine-profile-"))
    model, config, _ = load_jax_target(args.target, args.dtype, positions)
    peaks = roofline.measure_peaks()
    print(f"peaks, measured here: copy {peaks['copy_gb_s']:.0f} GB/s, matmul "
          f"{peaks['matmul_tflop_s']:.1f} TFLOP/s ({peaks['dtype']})")
    results = []
    for method in args.methods:
        result = profile(method, model, config, args, trace_dir, peaks)
        results.append(result)
        print(f"\n{method} ({result['attention_backend']}, {args.layer_kernels} layers, "
              f"batch {args.batch}, context "
              f"{context}, T {args.temperature:g}): {result['device_us_per_pass']:.0f} us of "
              "device time per pass")
        print(roofline.group_table(result["groups"]))
        print(top_table(result["top"]))
    if args.out:
        Path(args.out).write_text(json.dumps({"target": args.target, "device": str(
            jax.devices()[0]), "peaks": peaks, "results": results}, indent=2))


if __name__ == "__main__":
    main()
