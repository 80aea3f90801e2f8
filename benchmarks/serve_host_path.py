"""The server's host path alone: `dspine serve`'s HTTP side and engine thread over an
engine whose "device" only waits, streaming to `dspine bench serve`'s client in another
process. What it reports is the most a server of this machine's host can stream, and
where the GIL goes: tokenization, detokenization, server-sent events, metrics and the
engine thread's hand-off, without a model or an accelerator.

    python -m dspine_benchmarks.serve_host_path --concurrency 64 --tokens-per-step 14 \\
        --step-ms 4 --repeats 5 --out host.json

The stand-in engine admits up to --max-slots requests and, every step, waits --step-ms
(the GIL released, as while a device call runs) and gives each running request
--tokens-per-step tokens of the built-in target's vocabulary (14: four passes of a
DSpine call at tau 3.5; 8: eight AR passes), until it has max_tokens. The server is the
real app (`dspine_serve.app.create_app`) under uvicorn with the event loop and HTTP parser
given by --loop and --http, as `dspine serve` runs it. The ceiling of a step is
max(step-ms, the host's work per step); output tokens/s below
max_slots x tokens-per-step / step-ms means the host is the bottleneck.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

from dspine_jax.runtime.engine_core import EngineStats
from dspine_jax.runtime.requests import RequestOutput


class WaitingEngine:
    """An engine core with the interface `EngineLoop` and the app use, whose step waits
    instead of running a device call."""

    def __init__(self, max_slots: int, tokens_per_step: int, step_seconds: float,
                 vocab: list[int], max_model_len: int = 4096):
        self.max_slots, self.max_model_len = max_slots, max_model_len
        self.tokens_per_step, self.step_seconds, self.vocab = tokens_per_step, step_seconds, vocab
        self.decoder = types.SimpleNamespace(extra_capacity=0, block_size=16)
        self.compiling = 0
        self._running: dict[str, list] = {}     # id -> [prompt tokens, tokens left, emitted]
        self._waiting: list[tuple[str, int, int]] = []
        self._aborted: list[str] = []
        self._cursor = 0

    def check_request(self, prompt_token_ids, options) -> None:
        pass

    def add_request(self, request_id: str, prompt_token_ids, options) -> None:
        self._waiting.append((request_id, len(prompt_token_ids), options.max_tokens))

    def abort(self, request_id: str) -> bool:
        self._aborted.append(request_id)
        return True

    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._aborted)

    def step(self, on_first_tokens=None) -> list[RequestOutput]:
        outputs = []
        for rid in self._aborted:
            if self._running.pop(rid, None) is not None:
                outputs.append(RequestOutput(rid, [], True, "abort", [], 0, 0))
        self._aborted = []
        while self._waiting and len(self._running) < self.max_slots:
            rid, prompt, budget = self._waiting.pop(0)
            self._running[rid] = [prompt, budget, 0]
        time.sleep(self.step_seconds)           # the device call (the GIL released)
        for rid, state in list(self._running.items()):
            n = min(self.tokens_per_step, state[1])
            tokens = [self.vocab[(self._cursor + i) % len(self.vocab)] for i in range(n)]
            self._cursor += n
            state[1] -= n
            state[2] += n
            done = state[1] == 0
            outputs.append(RequestOutput(rid, tokens, done, "length" if done else None,
                                         [n], state[0], state[2], verify_width=15))
            if done:
                del self._running[rid]
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(max_slots=self.max_slots, running=len(self._running),
                           waiting=len(self._waiting), capacity_tokens=0, used_tokens=0,
                           num_pages=0, free_pages=0, preemptions=0)

    def close(self) -> None:
        pass


def sample_vocabulary(tokenizer, text: str) -> list[int]:
    """Token ids of ordinary text, so detokenization does what it does on real output."""
    return tokenizer.encode(text * 20)


def builtin_text():
    """The built-in target's tokenizer and the ordinary text a stand-in device emits."""
    from dspine_jax.checkpoints.gguf_file import GGUFCheckpoint
    from dspine_jax.registry import resolve_target
    from dspine_jax.tokenizer import TextTokenizer

    tokenizer = TextTokenizer.from_gguf(GGUFCheckpoint(resolve_target("smollm2-135m-instruct")))
    return tokenizer, sample_vocabulary(tokenizer, "The quick brown fox jumps over the lazy dog. ")


def write_report(report: dict, out: str | None) -> dict:
    """Print the report as JSON, and write it to `out` if given."""
    print(json.dumps(report, indent=1))
    if out:
        Path(out).write_text(json.dumps(report, indent=1))
    return report


def serve_once(args, tokenizer, vocab, port: int, core=None, method: str = "dspine") -> dict:
    """One server on `port` over `core` (default: the stand-in engine), one bench run."""
    import uvicorn

    from dspine_serve.app import create_app
    from dspine_serve.engine_loop import EngineLoop
    from dspine_serve.server import GIL_SWITCH_SECONDS

    sys.setswitchinterval(GIL_SWITCH_SECONDS)
    if core is None:
        core = WaitingEngine(args.max_slots, args.tokens_per_step, args.step_ms / 1e3, vocab)
    engine = EngineLoop(core, max_queue=4096)
    app = create_app(engine, tokenizer, model_name="host-path", method=method)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            access_log=False, loop=args.loop, http=args.http)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        out = Path(args.work) / f"run-{port}"
        cmd = [sys.executable, "-m", "dspine_cli", "bench", "serve", "--base-url",
               f"http://127.0.0.1:{port}", "--prompts", args.prompts, "--num-prompts",
               str(args.num_prompts), "--concurrency", str(args.concurrency), "--max-tokens",
               str(args.max_tokens), "--out", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        level = json.loads((out / "results.json").read_text())["levels"][0]
    finally:
        server.should_exit = True
        thread.join(30)
    return {k: level[k] for k in ("output_throughput", "completed", "failed",
                                  "total_output_tokens", "duration_s", "median_itl_ms",
                                  "mean_e2e_latency_ms", "median_ttft_ms",
                                  "device_prefill_share", "device_decode_share",
                                  "device_idle_share", "passes_by_verify_width") if k in level}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-slots", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--tokens-per-step", type=int, default=14)
    ap.add_argument("--step-ms", type=float, default=4.0)
    ap.add_argument("--prompts", default="sharegpt:heldout")
    ap.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"])
    ap.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--work", default="runs/host-path")
    ap.add_argument("--out", default=None, help="JSON of every run and the median")
    args = ap.parse_args(argv)
    if min(args.concurrency, args.max_slots, args.num_prompts, args.max_tokens,
           args.tokens_per_step, args.repeats) < 1 or args.step_ms < 0:
        ap.error("counts must be >= 1 and --step-ms >= 0")
    from dspine_benchmarks.train_scaling import free_port

    tokenizer, vocab = builtin_text()
    runs = [serve_once(args, tokenizer, vocab, free_port()) for _ in range(args.repeats)]
    ceiling = args.max_slots * args.tokens_per_step / (args.step_ms / 1e3) \
        if args.step_ms else None
    report = {"args": {k: v for k, v in vars(args).items() if k not in ("out", "work")},
              "device_ceiling_tokens_per_s": ceiling, "runs": runs,
              "median_tokens_per_s": statistics.median(r["output_throughput"] for r in runs)}
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
