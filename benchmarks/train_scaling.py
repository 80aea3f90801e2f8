"""Data-parallel and FSDP scaling of `dspine train` on one host: loss curves and tokens/s.

  python -m dspine_benchmarks.train_scaling --config train/configs/smollm2_dspine.toml \\
      --mesh 1x1 2x1 1x2 --steps 300 --set data.path=runs/data/sharegpt --out runs/scaling

Every mesh DATAxFSDP runs `dspine train` in its own process on DATA*FSDP devices (the first
ones of CUDA_VISIBLE_DEVICES on a GPU host; with --cpu, that many fake host devices), or with
--processes in one process per device joined by jax.distributed (the layout of a TPU pod,
or of one process per GPU), with the same config, data order and global batch. The first
mesh is the reference. Per mesh: steady tokens/s (the first logged window, which compiles,
is left out), scaling efficiency = tokens/s / (devices / reference devices x reference
tokens/s), MFU, peak device memory, and the loss gap to the reference at every logged step.
Writes runs.jsonl (one line per mesh), summary.md and scaling.png into --out.

Two checks localise a mesh that trains differently from one device:
  --collectives MIB   first, an all-reduce and an all-gather of MIB MiB over all devices,
                      every device's copy against numpy (the data-parallel gradient sum
                      and the fsdp parameter gather, without the model);
  first-step parity   every logged metric of the first logged step, mesh vs reference
                      (with --log-every 1: the forward pass and gradient norm before any
                      update has been applied).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def parse_mesh(text: str) -> tuple[int, int]:
    try:
        data, fsdp = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"mesh {text!r} is not DATAxFSDP, e.g. 2x1") from None
    if data < 1 or fsdp < 1:
        raise argparse.ArgumentTypeError(f"mesh {text!r}: both axes must be >= 1")
    return data, fsdp


def device_env(devices: int, cpu: bool, first: int = 0) -> dict:
    """Environment for a process that sees `devices` devices, starting at `first`."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            f" --xla_force_host_platform_device_count={devices}").strip()
        return env
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(first + devices)]
    if len(ids) < first + devices:
        raise SystemExit(f"a mesh needs {first + devices} GPUs; CUDA_VISIBLE_DEVICES has "
                         f"{len(ids)}")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[first:first + devices])
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


COLLECTIVES = """
import json, sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
n, floats = jax.device_count(), int(sys.argv[1]) * 2 ** 20 // 4
x = np.random.default_rng(0).standard_normal((n, floats // n)).astype(np.float32)
mesh = Mesh(np.asarray(jax.devices()), ("d",))
rows = jax.device_put(x, NamedSharding(mesh, P("d")))
everywhere = NamedSharding(mesh, P())
summed = jax.jit(lambda a: a.sum(0), out_shardings=everywhere)(rows)
gathered = jax.jit(lambda a: a, out_shardings=everywhere)(rows)
ref = x.astype(np.float64).sum(0)
out = {"devices": n, "mib": int(sys.argv[1]),
       "all_reduce_max_abs_err": [float(np.max(np.abs(np.asarray(s.data) - ref)))
                                  for s in summed.addressable_shards],
       "all_gather_exact": [bool(np.array_equal(np.asarray(s.data), x))
                            for s in gathered.addressable_shards]}
out["ok"] = max(out["all_reduce_max_abs_err"]) < 1e-4 * n and all(out["all_gather_exact"])
print(json.dumps(out))
"""


def check_collectives(devices: int, mib: int, cpu: bool) -> dict:
    done = subprocess.run([sys.executable, "-c", COLLECTIVES, str(mib)], capture_output=True,
                          text=True, env=device_env(devices, cpu), cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"collective check failed to run:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_mesh(mesh: tuple[int, int], args, out: Path) -> dict:
    """Train on one mesh, or reuse its finished run from an earlier, interrupted call (an
    unfinished one resumes from its checkpoint)."""
    data, fsdp = mesh
    wall_file = out.parent / f"{out.name}.wall_s"
    summary_file = out / "summary.json"
    if not (summary_file.is_file() and json.loads(summary_file.read_text())["finished"]):
        cmd = [sys.executable, "-m", "dspine_cli", "train", "--config", str(args.config),
               "--set", f"mesh.data={data}", "--set", f"mesh.fsdp={fsdp}",
               "--set", f"run.out={out}", "--set", f"run.steps={args.steps}",
               "--set", f"run.log_every={args.log_every}",
               "--set", f"run.checkpoint_every={args.steps}"]
        for kv in args.set:
            cmd += ["--set", kv]
        n = data * fsdp
        processes = n if args.processes and n > 1 else 1
        print(f"mesh {data}x{fsdp}: training {args.steps} steps in {processes} "
              f"process{'es' if processes > 1 else ''} ...", flush=True)
        start = time.perf_counter()
        if processes == 1:
            launches = [(cmd, device_env(n, args.cpu))]
        else:  # one process per device, as on a pod: jax.distributed over localhost
            port = free_port()
            launches = [(cmd + ["--distributed", "--coordinator", f"127.0.0.1:{port}",
                                "--num-processes", str(n), "--process-id", str(i)],
                         device_env(1, args.cpu, first=i)) for i in range(n)]
        logs = [open(out.parent / (f"{out.name}.log" if i == 0 else f"{out.name}.p{i}.log"),
                     "a") for i in range(len(launches))]
        running = [subprocess.Popen(c, env=e, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
                   for (c, e), log in zip(launches, logs)]
        codes = [p.wait() for p in running]
        for log in logs:
            log.close()
        if any(codes):
            raise SystemExit(f"mesh {data}x{fsdp} failed (exit codes {codes}); "
                             f"see {out.parent / (out.name + '.log')}")
        wall_file.write_text(f"{time.perf_counter() - start:.1f}\n")
    summary = json.loads(summary_file.read_text())
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return {"mesh": f"{data}x{fsdp}", "devices": data * fsdp, "rows": rows,
            "wall_s": float(wall_file.read_text()) if wall_file.is_file() else None,
            "peak_device_memory_bytes": summary.get("peak_device_memory_bytes")}


def summarise(runs: list[dict]) -> list[dict]:
    """Per mesh: steady throughput, efficiency and loss gap against runs[0]."""
    ref = runs[0]
    ref_loss = {int(r["step"]): float(r["loss"]) for r in ref["rows"]}
    results = []
    for run in runs:
        steady = [float(r["tokens_per_s"]) for r in run["rows"][1:]]
        if not steady:
            raise SystemExit("too few logged steps to time: raise --steps or lower --log-every")
        mfu = [float(r["mfu"]) for r in run["rows"][1:] if r.get("mfu")]
        gaps = [abs(float(r["loss"]) - ref_loss[int(r["step"])]) / ref_loss[int(r["step"])]
                for r in run["rows"] if int(r["step"]) in ref_loss]
        results.append({
            "mesh": run["mesh"], "devices": run["devices"],
            "tokens_per_s": statistics.median(steady),
            "mfu": statistics.median(mfu) if mfu else None,
            "final_loss": float(run["rows"][-1]["loss"]),
            # nan propagates: a mesh whose loss went nan must not read as a small gap
            "max_rel_loss_gap": float(np.max(gaps)), "mean_rel_loss_gap": float(np.mean(gaps)),
            "peak_device_memory_gib": (run["peak_device_memory_bytes"] / 2 ** 30
                                       if run["peak_device_memory_bytes"] else None),
            "wall_s": run["wall_s"],
            "nan_loss": any(r["loss"].lower() == "nan" for r in run["rows"])})
    base = results[0]["tokens_per_s"] / results[0]["devices"]
    for r in results:
        r["speedup"] = r["tokens_per_s"] / results[0]["tokens_per_s"]
        r["efficiency"] = r["tokens_per_s"] / (r["devices"] * base)
    return results


def first_step_parity(runs: list[dict]) -> list[dict]:
    """Every metric of the first logged step: relative gap of each mesh to runs[0]."""
    ref = runs[0]["rows"][0]
    skip = {"step", "lr", "tokens_per_s", "mfu"}
    table = []
    for key, value in ref.items():
        if key in skip or value in (None, ""):
            continue
        row = {"metric": key, "reference": float(value)}
        for run in runs[1:]:
            other = float(run["rows"][0].get(key) or "nan")
            row[run["mesh"]] = abs(other - float(value)) / max(
                abs(float(value)), 1e-6)  # nan when the mesh produced nan
        table.append(row)
    return table


def parity_markdown(table: list[dict], runs: list[dict]) -> str:
    meshes = [r["mesh"] for r in runs[1:]]
    lines = [f"first logged step ({runs[0]['rows'][0]['step']}): relative gap to the reference",
             "", "| metric | reference | " + " | ".join(meshes) + " |",
             "|---|---|" + "---|" * len(meshes)]
    for row in table:
        lines.append(f"| {row['metric']} | {row['reference']:.5g} | "
                     + " | ".join(f"{row[m]:.2e}" for m in meshes) + " |")
    return "\n".join(lines) + "\n"


def markdown(results: list[dict]) -> str:
    lines = ["| mesh (data x fsdp) | devices | tokens/s | speedup | efficiency | MFU | "
             "peak memory / device (GiB) | final loss | loss gap to ref (max / mean) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else ""
        mem = f"{r['peak_device_memory_gib']:.1f}" if r["peak_device_memory_gib"] else ""
        lines.append(f"| {r['mesh']} | {r['devices']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['speedup']:.2f}x | {r['efficiency']:.0%} | {mfu} | {mem} | "
                     f"{r['final_loss']:.4f} | {r['max_rel_loss_gap']:.2%} / "
                     f"{r['mean_rel_loss_gap']:.2%} |")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], results: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # DSpine's total loss rises while its alignment term warms up; the backbone CE is the
    # curve that shows learning. A mesh whose loss went NaN says so in the legend.
    fig, (curve, ce, bars) = plt.subplots(1, 3, figsize=(16, 4))
    for ax, key, title in ((curve, "loss", "total loss"), (ce, "backbone_ce", "backbone CE")):
        for run, r in zip(runs, results):
            values = [float(x.get(key) or "nan") for x in run["rows"]]
            ax.plot([int(x["step"]) for x in run["rows"]], values, alpha=0.8,
                    label=f"{r['mesh']} ({r['devices']} dev)" + (", NaN" if r["nan_loss"] else ""))
        ax.set(title=f"{title}, same global batch", xlabel="step")
        ax.legend()
    names = [r["mesh"] for r in results]
    bars.bar(names, [r["tokens_per_s"] for r in results], color="tab:blue")
    for i, r in enumerate(results):
        bars.text(i, r["tokens_per_s"], f"{r['speedup']:.2f}x\n{r['efficiency']:.0%} eff.",
                  ha="center", va="bottom", fontsize=8)
    bars.set(title="throughput", xlabel="mesh (data x fsdp)", ylabel="tokens/s")
    bars.margins(y=0.2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, required=True, help="A `dspine train` TOML config.")
    p.add_argument("--mesh", type=parse_mesh, nargs="+", default=[(1, 1), (2, 1), (1, 2)],
                   help="DATAxFSDP meshes; the first is the reference (default 1x1 2x1 1x2).")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--set", action="append", default=[], help="Extra config override.")
    p.add_argument("--cpu", action="store_true", help="Fake host devices instead of GPUs.")
    p.add_argument("--processes", action="store_true",
                   help="One process per device (jax.distributed over localhost, as on a pod "
                        "or one process per GPU) instead of one process for all.")
    p.add_argument("--collectives", type=int, default=0, metavar="MIB",
                   help="First check an all-reduce and all-gather of MIB MiB (0: skip).")
    p.add_argument("--out", type=Path, required=True, help="Folder for runs and results; "
                   "rerun with the same folder to reuse finished meshes.")
    args = p.parse_args()
    args.config, args.out = args.config.resolve(), args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.collectives:
        devices = max(d * f for d, f in args.mesh)
        check = check_collectives(devices, args.collectives, args.cpu)
        (args.out / "collectives.json").write_text(json.dumps(check, indent=2))
        print(f"collectives over {devices} devices: {json.dumps(check)}", flush=True)
    runs = []
    for mesh in args.mesh:
        runs.append(run_mesh(mesh, args, args.out / f"mesh-{mesh[0]}x{mesh[1]}"))
    results = summarise(runs)
    with open(args.out / "runs.jsonl", "w") as f:
        for r in results:
            f.write(json.dumps(dict(r, config=str(args.config), steps=args.steps,
                                    overrides=args.set, cpu=args.cpu,
                                    processes=args.processes,
                                    date=str(date.today()))) + "\n")
    table = markdown(results)
    if len(runs) > 1:
        table += "\n" + parity_markdown(first_step_parity(runs), runs)
    (args.out / "summary.md").write_text(table)
    plot(runs, results, args.out / "scaling.png")
    print(table)


if __name__ == "__main__":
    main()
