"""`dspine bench serve`: a load generator for a running server, in the shape of SGLang's
`bench_serving` (streaming requests; TTFT, inter-token latency, output tokens/s, request
throughput; concurrency and request-rate sweeps), so figures compare with theirs.

Per concurrency level, all prompts are sent as streaming requests, at most `concurrency`
in flight, arriving as a Poisson process of `request_rate` per second (inf: all at once).
Each request asks for `max_tokens` with ignore_eos (fixed output lengths, as
bench_serving's default) unless told otherwise. Measured per request: TTFT (send to the
first chunk with text), inter-token latencies (gaps between text chunks: a speculative
burst of k tokens is one chunk, as in bench_serving), end-to-end latency, output tokens
and the server's acceptance record (`usage.mean_accept_length`, `usage.target_passes`).

Loopback only: the URL must name 127.0.0.1, ::1 or localhost.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence
from urllib.parse import urlparse

import numpy as np

from dspine_jax.errors import InputError


@dataclass
class RequestRecord:
    ok: bool = False
    error: str = ""
    ttft: float = math.nan
    latency: float = math.nan
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    target_passes: int = 0


def check_loopback(base_url: str) -> str:
    url = urlparse(base_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise InputError(f"--base-url must look like http://127.0.0.1:8000, got {base_url!r}")
    host = url.hostname
    loopback = host == "localhost"
    try:
        loopback = loopback or ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not loopback:
        raise InputError(f"--base-url {base_url}: the benchmark sends load to loopback "
                         "servers only (127.0.0.1, ::1 or localhost)")
    return base_url.rstrip("/")


def load_prompts(source: str) -> list[dict]:
    """[{"prompt", "chat"}] from sharegpt:heldout or a JSONL file, in order."""
    from dspine_jax.data.prompts import jsonl_prompts, sharegpt_prompts

    if source in ("sharegpt:heldout", "sharegpt"):
        records = sharegpt_prompts("heldout" if source.endswith("heldout") else "train")
    else:
        records = jsonl_prompts(Path(source))
    records = [r for r in records if r["prompt"].strip()]
    if not records:
        raise InputError(f"{source}: no prompts")
    return records


def fitting_prompts(client, base_url: str, records: Sequence[dict], model: dict,
                    num_prompts: int, max_tokens: int) -> tuple[list[dict], int]:
    """The first `num_prompts` records whose prompt (tokenized by the server's /tokenize)
    leaves room for max_tokens, as bench_serving drops over-long ShareGPT prompts; cycled
    when fewer fit. Returns (prompts, number skipped as too long)."""
    room = model["max_model_len"] - model.get("reserved_tokens", 0) - max_tokens
    chosen, skipped = [], 0
    for record in records[:max(num_prompts * 20, 1000)]:
        body = ({"messages": [{"role": "user", "content": record["prompt"]}]}
                if record.get("chat", True) else {"prompt": record["prompt"]})
        count = client.post(base_url + "/tokenize", json=body).json()["count"]
        if count > room:
            skipped += 1
            continue
        chosen.append(record)
        if len(chosen) == num_prompts:
            break
    if not chosen:
        raise InputError(f"no prompt leaves room for {max_tokens} tokens in the server's "
                         f"context of {model['max_model_len']}; lower --max-tokens")
    return [chosen[i % len(chosen)] for i in range(num_prompts)], skipped


async def _one(client, base_url: str, model: str | None, prompt: dict, *, max_tokens: int,
               temperature: float, ignore_eos: bool, timeout: float) -> RequestRecord:
    body = {"max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if model:
        body["model"] = model
    if prompt.get("chat", True):
        path, body["messages"] = "/v1/chat/completions", [{"role": "user",
                                                          "content": prompt["prompt"]}]
    else:
        path, body["prompt"] = "/v1/completions", prompt["prompt"]
    record = RequestRecord()
    start = time.perf_counter()
    last = None
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", base_url + path, json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    record.error = f"HTTP {response.status_code}: {text[:300]}"
                    return record
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        record.error = chunk["error"].get("message", "error")
                        return record
                    now = time.perf_counter()
                    for choice in chunk.get("choices", []):
                        text = choice.get("text") or (choice.get("delta") or {}).get("content")
                        if text:
                            if last is None:
                                record.ttft = now - start
                            else:
                                record.itl.append(now - last)
                            last = now
                    if chunk.get("usage"):
                        u = chunk["usage"]
                        record.prompt_tokens = u.get("prompt_tokens", 0)
                        record.output_tokens = u.get("completion_tokens", 0)
                        record.target_passes = u.get("target_passes", 0)
    except (TimeoutError, asyncio.TimeoutError):
        record.error = f"timed out after {timeout}s"
        return record
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        record.error = f"{type(e).__name__}: {e}"
        return record
    record.latency = time.perf_counter() - start
    record.ok = record.output_tokens > 0 or not math.isnan(record.ttft)
    if not record.ok:
        record.error = "no output"
    return record


# what a level reads from /metrics before and after it (absent: nan)
# the verify widths adaptive speculation picks from (the histogram's cumulative buckets)
WIDTHS = (0, 1, 3, 7, 15)
SCRAPED = {"accept_sum": "dspine_accept_length_sum", "accept_count": "dspine_accept_length_count",
           **{f"device_{c}": f'dspine_device_seconds_total{{call="{c}"}}'
              for c in ("prefill", "decode", "idle")},
           **{f"width_le_{w}": f'dspine_verify_width_bucket{{le="{float(w)}"}}' for w in WIDTHS}}


async def _scrape(client, base_url: str) -> dict[str, float]:
    """The server's counters in `SCRAPED` (nan where absent, e.g. another server)."""
    try:
        text = (await client.get(base_url + "/metrics")).text
    except Exception:  # noqa: BLE001
        text = ""
    values = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        values[name] = value
    return {key: float(values.get(name, math.nan)) for key, name in SCRAPED.items()}


async def run_level(base_url: str, prompts: Sequence[dict], *, concurrency: int,
                    request_rate: float, max_tokens: int, temperature: float = 0.0,
                    ignore_eos: bool = True, model: str | None = None,
                    timeout: float = 600.0, seed: int = 0,
                    duration: float | None = None) -> dict:
    """Send `prompts` once each (at most `concurrency` in flight, Poisson arrivals at
    `request_rate`); with `duration`, a soak: cycle through them, sending until `duration`
    seconds have passed, then wait for the requests in flight."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits,
                                 trust_env=False) as client:
        before = await _scrape(client, base_url)
        gate = asyncio.Semaphore(concurrency)
        rng = random.Random(seed)

        async def limited(prompt):
            async with gate:
                return await _one(client, base_url, model, prompt, max_tokens=max_tokens,
                                  temperature=temperature, ignore_eos=ignore_eos,
                                  timeout=timeout)

        start = time.perf_counter()
        tasks = []
        if duration is not None and not math.isfinite(request_rate):
            # Closed loop: each of `concurrency` clients sends its next request as soon
            # as its last one ends.
            order = itertools.cycle(prompts)

            async def client_loop():
                done = []
                while time.perf_counter() - start < duration:
                    done.append(await limited(next(order)))
                return done

            loops = await asyncio.gather(*(client_loop() for _ in range(concurrency)))
            records = [r for done in loops for r in done]
        else:
            order = itertools.cycle(prompts) if duration is not None else iter(prompts)
            for prompt in order:
                if duration is not None and time.perf_counter() - start >= duration:
                    break
                tasks.append(asyncio.create_task(limited(prompt)))
                if math.isfinite(request_rate):
                    await asyncio.sleep(rng.expovariate(request_rate))
            records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = await _scrape(client, base_url)
    return summarize(records, duration, concurrency=concurrency, request_rate=request_rate,
                     server={k: after[k] - before[k] for k in SCRAPED})


def _ms(values, q) -> float:
    return float(np.percentile(values, q) * 1000) if len(values) else math.nan


def summarize(records: Sequence[RequestRecord], duration: float, *, concurrency: int,
              request_rate: float, server: dict[str, float] | None = None) -> dict:
    """`server`: the level's change in the server's counters (`SCRAPED`)."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft for r in ok if not math.isnan(r.ttft)]
    itl = [x for r in ok for x in r.itl]
    out_tokens = sum(r.output_tokens for r in ok)
    passes = sum(r.target_passes for r in ok)
    server = {k: math.nan for k in SCRAPED} | (server or {})
    accept_sum, accept_count = server["accept_sum"], server["accept_count"]
    device = {c: server[f"device_{c}"] for c in ("prefill", "decode", "idle")}
    below = [server[f"width_le_{w}"] for w in WIDTHS]
    by_width = {str(w): c - b for w, c, b in zip(WIDTHS, below, [0.0] + below[:-1])}
    return {
        "concurrency": concurrency,
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "duration_s": round(duration, 3),
        "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if not r.ok})[:5],
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": out_tokens,
        "request_throughput": round(len(ok) / duration, 3) if duration else math.nan,
        "output_throughput": round(out_tokens / duration, 2) if duration else math.nan,
        "mean_ttft_ms": round(float(np.mean(ttft)) * 1000, 2) if ttft else math.nan,
        "median_ttft_ms": round(_ms(ttft, 50), 2), "p99_ttft_ms": round(_ms(ttft, 99), 2),
        "mean_itl_ms": round(float(np.mean(itl)) * 1000, 2) if itl else math.nan,
        "median_itl_ms": round(_ms(itl, 50), 2), "p99_itl_ms": round(_ms(itl, 99), 2),
        "mean_e2e_latency_ms": round(float(np.mean([r.latency for r in ok])) * 1000, 2)
        if ok else math.nan,
        # Tokens per target pass: from the responses' usage (passes after prefill, so the
        # prefill's token is left out), and from the server's histogram over the run.
        "accept_length": round((out_tokens - len(ok)) / passes, 4) if passes else math.nan,
        "accept_length_metrics": round(accept_sum / accept_count, 4)
        if accept_count and accept_count > 0 else math.nan,
        # The server's device over the level (its /metrics): seconds running prefill and
        # decode calls, and idle between a call and the next one queued behind it (the
        # device waiting for the host), each also as a share of the level's duration.
        **{f"device_{c}_s": round(v, 4) for c, v in device.items()},
        **{f"device_{c}_share": round(v / duration, 4) if duration else math.nan
           for c, v in device.items()},
        # row-passes by the drafts they verified (0: a plain step), from the server's
        # histogram: what adaptive speculation picked at this level
        "passes_by_verify_width": {w: int(n) for w, n in by_width.items()
                                   if math.isfinite(n) and n > 0},
    }


def plot(levels: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [lv["concurrency"] for lv in levels]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].plot(x, [lv["output_throughput"] for lv in levels], "o-")
    axes[0].set_ylabel("output tokens/s")
    for key, label in (("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99")):
        axes[1].plot(x, [lv[key] for lv in levels], "o-", label=label)
    axes[1].set_ylabel("ms")
    for key, label in (("median_itl_ms", "ITL p50"), ("p99_itl_ms", "ITL p99")):
        axes[2].plot(x, [lv[key] for lv in levels], "o-", label=label)
    axes[2].set_ylabel("ms")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.grid(alpha=0.3)
    axes[1].legend()
    axes[2].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bench_serve(base_url: str, *, prompts: str = "sharegpt:heldout", num_prompts: int = 64,
                concurrency: Sequence[int] = (1, 8, 32, 64), request_rate: float = math.inf,
                max_tokens: int = 128, temperature: float = 0.0, ignore_eos: bool = True,
                out: Path | None = None, timeout: float = 600.0, seed: int = 0,
                duration: float | None = None, log=print) -> dict:
    """Run every concurrency level; write results.json and results.png into `out`.
    `duration` (seconds) makes each level a soak over the `num_prompts` prompts, cycled."""
    import httpx

    base_url = check_loopback(base_url)
    if num_prompts < 1 or max_tokens < 1 or not concurrency or min(concurrency) < 1:
        raise InputError("--num-prompts, --max-tokens and every --concurrency must be >= 1")
    if not request_rate > 0:
        raise InputError(f"--request-rate must be > 0 (inf: all at once), got {request_rate}")
    if duration is not None and not duration > 0:
        raise InputError(f"--duration must be > 0 seconds, got {duration}")
    sources = load_prompts(prompts)
    with httpx.Client(timeout=60, trust_env=False) as client:
        try:
            model = client.get(base_url + "/v1/models").json()["data"][0]
        except Exception as e:  # noqa: BLE001
            raise InputError(f"no server answers at {base_url}/v1/models: {e}") from e
        records, skipped = fitting_prompts(client, base_url, sources, model, num_prompts,
                                           max_tokens)
    if skipped:
        log(f"skipped {skipped} prompts too long for the server's context")
    levels = []
    for c in concurrency:
        level = asyncio.run(run_level(base_url, records, concurrency=c,
                                      request_rate=request_rate, max_tokens=max_tokens,
                                      temperature=temperature, ignore_eos=ignore_eos,
                                      model=model["id"], timeout=timeout, seed=seed,
                                      duration=duration))
        levels.append(level)
        sent = level["completed"] + level["failed"]
        log(f"concurrency {c:>4}: {level['completed']}/{sent} ok, "
            f"{level['output_throughput']:.1f} output tok/s, "
            f"{level['request_throughput']:.2f} req/s, TTFT p50/p99 "
            f"{level['median_ttft_ms']:.1f}/{level['p99_ttft_ms']:.1f} ms, ITL p50/p99 "
            f"{level['median_itl_ms']:.1f}/{level['p99_itl_ms']:.1f} ms, accept length "
            f"{level['accept_length']}")
    result = {"base_url": base_url, "model": model, "prompts": prompts,
              "num_prompts": num_prompts, "skipped_long_prompts": skipped,
              "max_tokens": max_tokens, "duration_s": duration,
              "temperature": temperature, "ignore_eos": ignore_eos,
              "request_rate": request_rate if math.isfinite(request_rate) else "inf",
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "levels": levels}
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(_finite(result), indent=2))
        plot(levels, out / "results.png",
             f"{model['id']} ({model.get('method', '?')}), {num_prompts} prompts, "
             f"max_tokens {max_tokens}")
    return result


def _finite(value):
    """NaN (no such measurement) as JSON null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
