"""Several `dspine serve` configurations benchmarked side by side, one server at a time:
each is started, waited for, swept `--repeats` times with `dspine bench serve`'s client,
and stopped before the next starts, so no server compiles or serves beside another.

    python -m dspine_benchmarks.serving_compare --out runs/serving --prompts prompts.jsonl \\
        --server "ar=--method ar" \\
        --server "dspine-fixed=--drafter smollm2-135m-instruct-dspine --speculation fixed" \\
        --server "dspine=--drafter smollm2-135m-instruct-dspine" \\
        --sweep 1:16 --sweep 8:64 --sweep 32,64:256 --repeats 5 \\
        -- --max-slots 64 --max-model-len 2048

`--server NAME=ARGS`: a name and its `dspine serve` arguments (the first is the baseline of
the x column); arguments after `--` go to every server. `--sweep C[,C...]:N`: concurrency
levels swept with N prompts. Give each level several times its concurrency in prompts:
with N = C every request starts at once and the run lasts as long as its slowest request,
which measures the spread of request latencies more than the server's rate (a
speculative server's requests differ in length more than AR's).

A server is measured once it is ready and every program it compiles in the background is
compiled (its /health "compiling" is 0): the rate it serves at from then on. Until then
calls run on wider programs and the compiling shares the host (`serve_startup` measures
that start-up).

Writes OUT/NAME/start.json (seconds to ready and to every program compiled, and /health
as the runs begin), OUT/NAME/run-R-S/results.json for every run, with the server's /health and
/metrics at its end (health.json: adaptive speculation's costs and acceptance so far;
metrics.txt: the verify widths chosen so far), OUT/NAME/health.json (the server's
/health after its runs: its runtime, and adaptive speculation's costs) and
OUT/summary.json (`serving_summary`: per level, the median over the runs).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from dspine_benchmarks import serving_summary
from dspine_benchmarks.train_scaling import free_port


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", action="append", required=True, metavar="NAME=ARGS")
    ap.add_argument("--sweep", action="append", default=None, metavar="C[,C...]:N")
    ap.add_argument("--prompts", default="sharegpt:heldout")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ready-timeout", type=float, default=1800.0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("serve_args", nargs="*", help="after --: arguments for every server")
    args = ap.parse_args(argv)
    servers = []
    for spec in args.server:
        name, sep, rest = spec.partition("=")
        if not sep or not name or not name.replace("-", "").replace("_", "").isalnum():
            ap.error(f"--server {spec!r}: expected NAME=ARGS, NAME of letters, digits, - or _")
        servers.append((name, shlex.split(rest)))
    if len({n for n, _ in servers}) != len(servers):
        ap.error("--server names must differ")
    sweeps = []
    for spec in args.sweep or ["1:16", "8:64", "32,64:256"]:
        levels, sep, n = spec.partition(":")
        try:
            sweeps.append(([int(c) for c in levels.split(",")], int(n)))
        except ValueError:
            ap.error(f"--sweep {spec!r}: expected C[,C...]:N, e.g. 8,32,64:64")
        if not sep or min(sweeps[-1][0]) < 1 or sweeps[-1][1] < 1:
            ap.error(f"--sweep {spec!r}: levels and prompts must be positive")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    return args, servers, sweeps


def wait_ready(proc, url: str, timeout: float) -> tuple[float, float, dict]:
    """-> (seconds until /health answered 200, until it also reported no program compiling
    in the background, that /health)."""
    import httpx

    t0 = time.perf_counter()
    ready = None
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited:\n{proc.stdout.read()}")
        if time.perf_counter() - t0 > timeout:
            raise SystemExit(f"no ready server with every program compiled at {url} after "
                             f"{timeout:.0f}s")
        try:
            health = httpx.get(url + "/health", timeout=2, trust_env=False)
            if health.status_code == 200:
                ready = ready or time.perf_counter() - t0
                state = health.json()
                if state.get("compiling", 0) == 0:
                    return ready, time.perf_counter() - t0, state
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def run_server(name, serve_args, sweeps, args, log=print) -> None:
    from dspine_serve.bench import bench_serve

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    folder = args.out / name
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "dspine_cli", "serve", "--port", str(port),
                             *serve_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        ready, compiled, start = wait_ready(proc, url, args.ready_timeout)
        log(f"{name}: ready after {ready:.1f}s, every program compiled after {compiled:.1f}s")
        (folder / "start.json").write_text(json.dumps(
            {"ready_s": round(ready, 1), "compiled_s": round(compiled, 1), "health": start},
            indent=1))
        for r in range(1, args.repeats + 1):
            for s, (levels, n) in enumerate(sweeps, 1):
                run = folder / f"run-{r}-{s}"
                bench_serve(url, prompts=args.prompts, num_prompts=n, concurrency=levels,
                            max_tokens=args.max_tokens, temperature=args.temperature,
                            out=run, log=lambda *_: None)
                # what the server learned and chose by the end of this run (adaptive
                # speculation's costs and acceptance; its verify-width histogram)
                health = snapshot(url, run)
        # the server after its runs: the last run's snapshot
        (folder / "health.json").write_text(json.dumps(health, indent=1))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()


def snapshot(url: str, folder: Path) -> dict:
    """The server's /health and /metrics into folder (health.json, metrics.txt); returns
    the /health."""
    import httpx

    health = httpx.get(url + "/health", timeout=10, trust_env=False).json()
    (folder / "health.json").write_text(json.dumps(health, indent=1))
    metrics = httpx.get(url + "/metrics", timeout=10, trust_env=False)
    (folder / "metrics.txt").write_text(metrics.text)
    return health


def main(argv=None):
    args, servers, sweeps = parse(argv)
    sys.stdout.reconfigure(line_buffering=True)
    for name, serve_args in servers:
        run_server(name, serve_args + args.serve_args, sweeps, args)
    serving_summary.main([str(args.out / name) for name, _ in servers]
                         + ["--out", str(args.out / "summary.json")])


if __name__ == "__main__":
    main()
