"""`dspine data regenerate`: prompts -> the target's own responses, as token shards.

Drafters learn to predict the target, so their training data is what the target itself
says. Prompts go through the chat template; with `turns="all"` every human turn of a
ShareGPT conversation is a prompt, with the turns before it as its context, cut from the
left by whole turns to fit `max_prompt_tokens` (cut prompts and dropped turns are counted
in the manifest; a prompt whose last turn alone is too long is skipped and counted).
Each prompt is answered once per temperature in `temperatures`, `samples_per_prompt`
times at every T > 0 (greedy answers would repeat: T = 0 gives one). Responses are
decoded by the same engine as everything else: continuous batching over one shared KV
page pool (a finished row takes the next response at once; every response draws from its
own seed; the next shard's requests are queued as soon as none waits, so a shard's last
long responses do not leave slots idle).
They land in shards of `shard_size` prompts (all of their responses), in order, with a
loss mask on the response tokens; a shard's `seconds` is the decoding time since the
previous shard was done.

Rerunning the same command resumes after the last finished shard; a different command on
the same folder (any setting that changes the data, or a folder made by an older
version) is refused rather than mixed in.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dspine_jax.data.prompts import fit_chat, jsonl_prompts, sharegpt_prompts
from dspine_jax.data.shards import (MANIFEST, Sequence, read_manifest, token_dtype,
                                    write_manifest, write_shard)
from dspine_jax.errors import InputError

FORMAT = 2  # manifest format: 1 (no field) had one temperature, first turns, int32 shards
COUNTERS = ("skipped_long_prompts", "truncated_prompts", "dropped_context_turns")


def load_prompts(source: str, turns: str = "first") -> list[dict]:
    if source in ("sharegpt", "sharegpt:train"):
        return sharegpt_prompts("train", turns=turns)
    if source == "sharegpt:heldout":
        return sharegpt_prompts("heldout", turns=turns)
    if turns != "first":
        raise InputError("--turns applies to ShareGPT; a JSONL file gives each prompt's "
                         'context itself (a "messages" list)')
    return jsonl_prompts(Path(source))


def response_plan(temperatures: list[float], samples_per_prompt: int) -> list[float]:
    """One temperature per response of a prompt: T = 0 once, every T > 0 n times."""
    return [t for t in temperatures for _ in range(1 if t == 0 else samples_per_prompt)]


def encode(tokenizer, prompt: dict, max_tokens: int) -> tuple[list[int], int] | None:
    """(ids, context turns dropped) of a prompt, or None when it cannot fit."""
    if prompt["chat"]:
        messages = prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}]
        return fit_chat(tokenizer, messages, max_tokens)
    ids = tokenizer.encode(prompt["prompt"])
    return (ids, 0) if len(ids) <= max_tokens else None


def regenerate(out: Path, *, target: str, source: str = "sharegpt", turns: str = "first",
               limit: int | None = None, max_new_tokens: int = 256,
               max_prompt_tokens: int = 512, temperatures: list[float] = (0.0,),
               samples_per_prompt: int = 1, top_p: float = 1.0, seed: int = 0,
               batch_size: int = 32, shard_size: int = 256, dtype: str = "auto",
               num_pages: int | None = None, max_seconds: float | None = None) -> dict:
    """num_pages: the engine's KV page pool (see `slot_engine`); it and batch_size
    change the speed, never the data. max_seconds: stop once a shard
    lands this long after the call began (loading and compiling included); the manifest
    then says `complete: false` and the same call resumes at the next shard."""
    from dspine_jax.api import Pipeline

    began = time.perf_counter()
    out = Path(out)
    temperatures = [float(t) for t in temperatures]
    if not temperatures or len(set(temperatures)) != len(temperatures):
        raise InputError(f"temperatures must be distinct values, got {temperatures}")
    if samples_per_prompt < 1:
        raise InputError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
    if max_seconds is not None and not max_seconds > 0:
        raise InputError(f"max_seconds must be positive, got {max_seconds!r}")
    settings = dict(format=FORMAT, target=target, source=source, turns=turns, limit=limit,
                    max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
                    temperatures=temperatures, samples_per_prompt=samples_per_prompt,
                    top_p=top_p, seed=seed, shard_size=shard_size,
                    engine="slots")   # what decoded the data (older versions had another)
    if (out / MANIFEST).is_file():
        manifest = read_manifest(out)
        if manifest["settings"] != settings:
            changed = sorted(k for k in settings if manifest["settings"].get(k) != settings[k])
            raise InputError(f"{out} holds data made with other settings ({', '.join(changed)});"
                             " choose another --out or rerun with the same options")
    else:
        out.mkdir(parents=True, exist_ok=True)
        manifest = dict(settings=settings, token_dtype=None, shards=[],
                        **{name: 0 for name in COUNTERS})
    prompts = load_prompts(source, turns)[:limit]
    done = sum(s["prompts"] for s in manifest["shards"])
    pipe = Pipeline.load(target, dtype=dtype, serving=True)
    vocab = max(pipe.decoder.config.vocab_size, pipe.tokenizer.vocab_size)
    manifest["token_dtype"] = manifest["token_dtype"] or token_dtype(vocab)
    plan = response_plan(temperatures, samples_per_prompt)
    progress = tqdm(total=len(prompts) * len(plan), initial=done * len(plan), unit="response",
                    desc="regenerate")
    # Every batch this size: one compiled shape per prompt bucket, not per batch size.
    rows = min(batch_size, len(prompts) * len(plan))
    core = slot_engine(pipe.decoder, rows, max_prompt_tokens + max_new_tokens, num_pages)
    if done < len(prompts):
        # Every call shape at once, compiled in parallel. Compiled lazily, one at a time,
        # they made the first shard take 224 s on the H200 (512 slots), the others 30-45.
        with pipe.decoder.switches.active():
            seconds = core.warmup(sampling_modes(temperatures, top_p))
        manifest["compile_seconds"] = round(manifest.get("compile_seconds", 0) + seconds, 3)
        progress.write(f"compiled the engine's calls in {seconds:.0f} s")
    chunks = (encode_chunk(pipe.tokenizer, prompts, start, shard_size, max_prompt_tokens)
              for start in range(done, len(prompts), shard_size))
    decoded = decode_slots(core, chunks, plan, seed, max_new_tokens, top_p, progress)
    for chunk, responses, seconds in decoded:
        shard = len(manifest["shards"])
        sequences = []
        for ids, answers in zip(chunk.encoded, responses):
            for answer in answers:
                tokens = np.asarray(ids + answer, np.int32)
                sequences.append(Sequence(tokens, np.arange(len(tokens)) >= len(ids)))
        progress.update((chunk.prompts - len(chunk.encoded)) * len(plan))
        name = (write_shard(out, shard, sequences, manifest["token_dtype"])
                if sequences else None)
        manifest["shards"].append(dict(file=name, prompts=chunk.prompts,
                                       sequences=len(sequences),
                                       tokens=int(sum(len(s.tokens) for s in sequences)),
                                       response_tokens=int(sum(s.loss_mask.sum()
                                                               for s in sequences)),
                                       seconds=round(seconds, 3), **chunk.counts))
        for key, value in chunk.counts.items():
            manifest[key] += value
        done += chunk.prompts
        manifest["complete"] = done >= len(prompts)
        write_manifest(out, manifest)
        if max_seconds is not None and time.perf_counter() - began >= max_seconds:
            break              # the shards in flight are dropped; a rerun redoes them
    progress.close()
    manifest["complete"] = done >= len(prompts)
    return manifest


@dataclasses.dataclass
class Chunk:
    """One shard's prompts: those that fit, encoded, with their index in the source."""
    prompts: int                 # prompts of the source in this shard (fitting or not)
    encoded: list[list[int]]
    index: list[int]
    counts: dict[str, int]       # COUNTERS


def encode_chunk(tokenizer, prompts: list[dict], start: int, size: int,
                 max_prompt_tokens: int) -> Chunk:
    chunk = prompts[start:start + size]
    counts = dict.fromkeys(COUNTERS, 0)
    encoded, index = [], []
    for k, p in enumerate(chunk):
        fitted = encode(tokenizer, p, max_prompt_tokens)
        if fitted is None:
            counts["skipped_long_prompts"] += 1
            continue
        encoded.append(fitted[0])
        index.append(start + k)
        counts["truncated_prompts"] += fitted[1] > 0
        counts["dropped_context_turns"] += fitted[1]
    return Chunk(len(chunk), encoded, index, counts)


def slot_engine(decoder, max_slots: int, longest: int, num_pages: int | None = None):
    """The serving engine's core sized for a regeneration, not for serving: requests are
    at most `longest` = max_prompt_tokens + max_new_tokens positions (plus the verify
    block of a speculative decoder), so that is the slots' max_model_len (capped at the
    model's context) instead of the context itself. The shared page pool defaults to
    every slot holding such a request at once, so no response is ever preempted; a
    smaller pool fits more slots in the same memory and preempts the newest response when
    it runs short (it is recomputed later from its own seed: the data do not change)."""
    from dspine_jax.page_pool import pages_needed
    from dspine_jax.runtime.engine_core import EngineConfig, EngineCore

    max_model_len = min(longest + decoder.extra_capacity,
                        decoder.config.max_position_embeddings)
    if num_pages is None:
        num_pages = max_slots * pages_needed(max_model_len, decoder.page_size)
    return EngineCore(decoder, EngineConfig(max_slots=max_slots, max_model_len=max_model_len,
                                            num_pages=num_pages))


def sampling_modes(temperatures: list[float], top_p: float) -> list[str]:
    """The slot engine's decode modes a regeneration's calls can take: a call's mode is
    that of its rows together, and a mix of greedy and sampled rows samples (under the
    switches in effect: the decoder's)."""
    from dspine_jax.sampling import SAMPLING_MODES, batch_sampling_mode

    modes = {batch_sampling_mode(np.float32([t]), np.float32([top_p]), np.int32([0]))
             for t in temperatures}
    return [m for m in SAMPLING_MODES if m in modes]


def response_seed(seed: int, prompt_index: int, response: int) -> int:
    """A response's own seed (uint32, the engine's row key): the run's seed, the prompt's
    index in the source and the response's index in the plan."""
    return int(np.random.SeedSequence([seed, prompt_index, response]).generate_state(1)[0])


def decode_slots(core, chunks, plan, seed, max_new_tokens, top_p, progress):
    """Yield (chunk, responses, seconds) per chunk, in order, from the slot engine
    (continuous batching: a finished response's slot takes the next one at once).
    responses[i][j] is prompt i's response j; seconds is the decoding time since the
    previous chunk was done. The next chunk's requests are queued as soon as no request
    waits, so the slots its last responses leave free do not idle while they finish (the
    tail of a chunk overlaps the next). Each response draws from its own seed (of the
    prompt's index in the source and j): the engine keeps one RNG key per row, so a
    response is the same whatever the slot count, the pool size (a preempted response is
    recomputed from the same key) or the responses decoded beside it."""
    from dspine_jax.runtime.engine_core import SamplingOptions  # the serving engine's slots

    chunks = iter(chunks)
    queued = collections.deque()     # [chunk, responses, requests left], oldest first
    where = {}                       # request id -> (its chunk's entry, i, j)

    def queue_next() -> bool:
        chunk = next(chunks, None)
        if chunk is None:
            return False
        entry = [chunk, [[None] * len(plan) for _ in chunk.encoded],
                 len(chunk.encoded) * len(plan)]
        for i, prompt in enumerate(chunk.encoded):
            for j, t in enumerate(plan):
                key = f"{chunk.index[i]}/{j}"
                core.add_request(key, prompt, SamplingOptions(
                    max_tokens=max_new_tokens, temperature=t, top_p=top_p,
                    seed=response_seed(seed, chunk.index[i], j)))
                where[key] = entry, i, j
                entry[1][i][j] = []
        queued.append(entry)
        return True

    more = queue_next()
    last = time.perf_counter()
    while queued:
        if more and not core.num_waiting:
            more = queue_next()
        if core.has_work():
            for out in core.step():
                entry, i, j = where[out.request_id]
                entry[1][i][j] += out.new_token_ids
                if out.finished:
                    del where[out.request_id]
                    entry[2] -= 1
                    progress.update(1)
        while queued and queued[0][2] == 0:
            chunk, responses, _ = queued.popleft()
            now = time.perf_counter()
            yield chunk, responses, now - last
            last = time.perf_counter()   # writing the shard is not decoding
