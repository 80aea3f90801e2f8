"""`dspine data regenerate`: prompts -> the target's own responses, as token shards.

Drafters learn to predict the target, so their training data is what the target itself
says (T = 0 by default). Prompts go through the chat template, are decoded in batches by
the same engine as everything else, and land in shards of `shard_size` prompts with a loss
mask on the response tokens. Rerunning the same command resumes after the last finished
shard; a different command on the same folder is refused rather than mixed in.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from dspine_jax.data.prompts import jsonl_prompts, sharegpt_prompts
from dspine_jax.data.shards import (MANIFEST, Sequence, read_manifest, write_manifest,
                                    write_shard)
from dspine_jax.decoding import padded_batch
from dspine_jax.errors import InputError


def load_prompts(source: str) -> list[dict]:
    if source in ("sharegpt", "sharegpt:train"):
        return sharegpt_prompts("train")
    if source == "sharegpt:heldout":
        return sharegpt_prompts("heldout")
    return jsonl_prompts(Path(source))


def regenerate(out: Path, *, target: str, source: str = "sharegpt", limit: int | None = None,
               max_new_tokens: int = 256, max_prompt_tokens: int = 512,
               temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
               batch_size: int = 32, shard_size: int = 256, dtype: str = "auto") -> dict:
    from dspine_jax.api import Pipeline, Prompt

    out = Path(out)
    settings = dict(target=target, source=source, limit=limit, max_new_tokens=max_new_tokens,
                    max_prompt_tokens=max_prompt_tokens, temperature=temperature,
                    top_p=top_p, seed=seed, shard_size=shard_size)
    if (out / MANIFEST).is_file():
        manifest = read_manifest(out)
        if manifest["settings"] != settings:
            changed = sorted(k for k in settings if manifest["settings"].get(k) != settings[k])
            raise InputError(f"{out} holds data made with other settings ({', '.join(changed)});"
                             " choose another --out or rerun with the same options")
    else:
        out.mkdir(parents=True, exist_ok=True)
        manifest = dict(settings=settings, shards=[], skipped_long_prompts=0)
    prompts = load_prompts(source)[:limit]
    done = sum(s["prompts"] for s in manifest["shards"])
    pipe = Pipeline.load(target, dtype=dtype)
    progress = tqdm(total=len(prompts), initial=done, unit="prompt", desc="regenerate")
    rows = min(batch_size, len(prompts))  # every batch this size: one shape per prompt bucket
    for start in range(done, len(prompts), shard_size):
        chunk = prompts[start:start + shard_size]
        encoded = [pipe.encode(Prompt(p["prompt"], p["chat"])) for p in chunk]
        keep = [ids for ids in encoded if len(ids) <= max_prompt_tokens]
        sequences = []
        for b in range(0, len(keep), batch_size):
            batch = keep[b:b + batch_size]
            # Full-size batches only: one compiled shape per prompt bucket, not per size.
            result = pipe.decoder.generate(padded_batch(batch, rows),
                                           max_new_tokens=max_new_tokens,
                                           temperature=temperature, top_p=top_p,
                                           seed=seed + start + b)
            for ids, gen in zip(batch, result.generations):  # pad rows dropped
                tokens = np.asarray(ids + gen.tokens, np.int32)
                mask = np.arange(len(tokens)) >= len(ids)
                sequences.append(Sequence(tokens, mask))
            progress.update(len(batch))
        progress.update(len(chunk) - len(keep))
        name = write_shard(out, len(manifest["shards"]), sequences) if sequences else None
        manifest["shards"].append(dict(file=name, prompts=len(chunk), sequences=len(sequences),
                                       tokens=int(sum(len(s.tokens) for s in sequences)),
                                       response_tokens=int(sum(s.loss_mask.sum()
                                                               for s in sequences))))
        manifest["skipped_long_prompts"] += len(chunk) - len(keep)
        write_manifest(out, manifest)
    progress.close()
    return manifest
