"""Prompt sources: ShareGPT conversations (with a fixed held-out split) and user JSONL."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterator

import numpy as np

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


ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant"}  # other roles (system: 41 turns) dropped


def conversation_of(conversation_id: str) -> str:
    """The original conversation a ShareGPT id belongs to: long conversations were cut into
    segments `ID_0`, `ID_1`, ... that continue one another."""
    base, _, number = conversation_id.rpartition("_")
    return base if base and number.isdigit() else conversation_id


def sharegpt_prompts(split: str = "train", *, path: Path | None = None,
                     turns: str = "first") -> list[dict]:
    """ShareGPT prompts: [{"id", "conversation", "prompt", "messages", "chat": True}].

    turns "first": the first human turn of each conversation (messages = that turn);
    "all": every human turn, with the turns before it (ShareGPT's own replies) as its
    chat context in `messages`, which ends with that turn; ids `ID#k` (k counts messages).

    split "heldout" is the conversations whose id hashes into the held-out 5%
    (`is_held_out`, fixed: the evaluation set). split "train" excludes more: every segment
    of an original conversation (`conversation_of`) one of whose segments is held out, so
    no turn of a held-out conversation, nor its continuation, is trained on."""
    if split not in ("train", "heldout"):
        raise InputError(f"split must be 'train' or 'heldout', got {split!r}")
    if turns not in ("first", "all"):
        raise InputError(f"turns must be 'first' or 'all', got {turns!r}")
    path = path or fetch_packaged(DATASETS["sharegpt"])
    conversations = list(iter_json_objects(path))
    held_bases = {conversation_of(str(c.get("id", ""))) for c in conversations
                  if is_held_out(str(c.get("id", "")))}
    prompts = []
    for conv in conversations:
        cid = str(conv.get("id", ""))
        keep = (is_held_out(cid) if split == "heldout"
                else conversation_of(cid) not in held_bases)
        if not keep:
            continue
        kept = [t for t in conv.get("conversations") or [] if t.get("from") in ROLES]
        messages = [{"role": ROLES[t["from"]], "content": str(t.get("value", ""))}
                    for t in kept]
        for k, message in enumerate(messages):
            if turns == "first" and kept[k]["from"] != "human":
                continue  # the evaluation set's rule: the first "human" turn, or none
            if message["role"] != "user" or not message["content"].strip():
                if turns == "first":
                    break
                continue
            prompts.append({"id": cid if turns == "first" else f"{cid}#{k}",
                            "conversation": conversation_of(cid), "prompt": message["content"],
                            "messages": messages[:k + 1] if turns == "all" else [message],
                            "chat": True})
            if turns == "first":
                break
    return prompts


def fit_chat(tokenizer, messages: list[dict], max_tokens: int) -> tuple[list[int], int] | None:
    """The chat-template ids of `messages`, cut from the left by whole turns until they
    fit in max_tokens: (ids, number of turns dropped), or None when even the last user
    turn alone is too long. The kept context always starts with a user turn."""
    starts = [i for i, m in enumerate(messages) if m["role"] == "user"]
    # Each turn's own token count is a lower bound of what it adds to the rendered
    # template: skip starts that cannot fit without rendering them.
    sizes = [len(tokenizer.encode(m["content"], add_special_tokens=False)) for m in messages]
    tail = np.cumsum(sizes[::-1])[::-1]
    for start in starts:
        if tail[start] > max_tokens:
            continue
        ids = tokenizer.encode_chat(messages[start:])
        if len(ids) <= max_tokens:
            return ids, start
    return None


def read_jsonl(path) -> list[tuple[int, object]]:
    """(line number, parsed record) for every non-blank line of a prompts file; a missing
    file or a line that is not JSON is an error naming the file (and the line)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such prompts file")
    records = []
    # JSON Lines ends a line at "\n" alone: splitlines() would also cut inside strings
    # that hold U+2028, U+0085 or other separators written unescaped (ensure_ascii=False)
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if not line.strip():
            continue
        try:
            records.append((number, json.loads(line)))
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{number}: not valid JSON ({e.msg})") from e
    return records


def jsonl_prompts(path: Path, *, default_chat: bool = True) -> list[dict]:
    """User prompts: one {"prompt": str, "chat": bool, "id"?} per line, or
    {"messages": [{"role", "content"}, ...], "id"?} (a chat whose last message is the user
    turn to answer: the turns before it are its context); a malformed line is an error
    naming its number."""
    prompts = []
    for number, record in read_jsonl(path):
        messages = record.get("messages") if isinstance(record, dict) else None
        if messages is not None:
            if (not isinstance(messages, list) or not messages
                    or not all(isinstance(m, dict) and m.get("role") in ("user", "assistant")
                               and isinstance(m.get("content"), str) for m in messages)
                    or messages[-1]["role"] != "user"):
                raise InputError(f'{path}:{number}: "messages" must be a list of '
                                 '{"role": "user"|"assistant", "content": str} ending with a '
                                 'user turn')
            prompts.append({"id": str(record.get("id", number)),
                            "prompt": messages[-1]["content"],
                            "messages": [{"role": m["role"], "content": m["content"]}
                                         for m in messages], "chat": True})
            continue
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise InputError(f'{path}:{number}: expected an object with a string "prompt" '
                             'or a list of "messages"')
        chat = record.get("chat", default_chat)
        if not isinstance(chat, bool):
            raise InputError(f'{path}:{number}: "chat" must be true or false')
        prompts.append({"id": str(record.get("id", number)), "prompt": record["prompt"],
                        "chat": chat})
    if not prompts:
        raise InputError(f"{path}: no prompts")
    return prompts
