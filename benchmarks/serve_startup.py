"""How long `dspine serve` takes to be ready, from a cold compilation cache and on
restarts that find the programs there.

    python -m dspine_benchmarks.serve_startup --drafter smollm2-135m-instruct-dspine \
        --max-slots 8 --restarts 5 --out startup.json

Starts the server on one new compilation cache folder (`--compile-cache-dir`), once cold
and then `--restarts` times: each time it times the first answer on /health (503
"starting" while the server compiles the programs that run any request), the first 200,
one completion, and the moment /health reports no program left compiling in the
background; then it stops the server with SIGTERM. The summary gives the restarts'
medians. Extra arguments after `--` go to `dspine serve`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def start(serve_args: list[str], cache: str, port: int, timeout: float) -> dict:
    import httpx

    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "dspine_cli", "serve", "--port", str(port),
                             "--compile-cache-dir", cache, *serve_args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = None
    try:
        while True:
            if time.perf_counter() - t0 > timeout:
                raise SystemExit(f"no ready server after {timeout}s")
            if proc.poll() is not None:
                raise SystemExit(f"the server exited:\n{proc.stdout.read()}")
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False)
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            if first is None:
                first = {"seconds": round(time.perf_counter() - t0, 2),
                         "status": r.status_code, "body": r.json().get("status")}
            if r.status_code == 200:
                break
            time.sleep(0.2)
        ready = time.perf_counter() - t0
        later = r.json().get("compiling", 0)
        # the first request may wait for a program still compiling: as long as the run
        # may take, and a request that never answers is reported, not a crash
        try:
            done = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                              timeout=max(10.0, timeout - ready), trust_env=False,
                              json={"prompt": "hello", "max_tokens": 8}).status_code
        except httpx.TimeoutException:
            done = "timed out"
        first_completion = time.perf_counter() - t0
        # while the rest compile: how long /health takes to answer (the event loop's wait
        # for the GIL beside the compile threads)
        compiling, waits = r.json().get("compiling", 0), []
        while compiling:
            if time.perf_counter() - t0 > timeout:
                raise SystemExit(f"programs still compiling after {timeout}s")
            time.sleep(0.5)
            asked = time.perf_counter()
            try:
                compiling = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30,
                                      trust_env=False).json().get("compiling", 0)
            except httpx.TransportError:
                pass
            waits.append(time.perf_counter() - asked)
        everything = time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
    return {"first_answer": first, "ready_seconds": round(ready, 2),
            "compiling_when_ready": later,
            "completion_status": done,
            "first_completion_seconds": round(first_completion, 2),
            "all_compiled_seconds": round(everything, 2),
            "health_while_compiling_seconds": {
                "answers": len(waits), "median": round(statistics.median(waits), 3) if waits
                else None, "max": round(max(waits), 3) if waits else None},
            "log": [line for line in out.splitlines()
                    if line.startswith(("serving", "ready", "compiled every"))],
            # how each program before ready was made: "decode 1 row, greedy, width 15:
            # traced 1.2s, compiled 3.4s" (or read from the program store)
            "programs": [line.strip() for line in out.splitlines()
                         if line.startswith(("  decode", "  prefill"))],
            # a request that never answered: what the server said last
            **({"log_tail": out.splitlines()[-40:]} if done != 200 else {})}


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--max-slots", type=int, default=8)
    ap.add_argument("--port", type=int, default=8123, help="this one and the next two")
    ap.add_argument("--restarts", type=int, default=1, help="starts after the cold one")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv[:cut])
    serve_args = (["--target", args.target] if args.target else []) + (
        ["--drafter", args.drafter] if args.drafter else []) + [
        "--max-slots", str(args.max_slots)] + argv[cut + 1:]
    if args.restarts < 1:
        ap.error("--restarts must be at least 1")
    with tempfile.TemporaryDirectory() as cache:
        report = {"date": datetime.date.today().isoformat(), "serve_args": serve_args,
                  "cold": start(serve_args, cache, args.port, args.timeout)}
        restarts = [start(serve_args, cache, args.port + 1 + i % 2, args.timeout)
                    for i in range(args.restarts)]
    report["restart"] = restarts[0]
    report["restarts"] = restarts
    report["restart_median"] = {
        key: statistics.median(r[key] for r in restarts)
        for key in ("ready_seconds", "first_completion_seconds", "all_compiled_seconds")}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
