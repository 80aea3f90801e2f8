"""The portable prompts file (`python -m dspine_train.prompt_file`): first turns before
later ones, each prompt cut to the budget by whole turns, one ASCII line per prompt that
`dspine data regenerate --source FILE.jsonl` reads back as the same chat."""

from __future__ import annotations

import json

import pytest

from dspine_jax.data.prompts import fit_chat, is_held_out, jsonl_prompts
from tests.conftest import save_hf_model, write_tiny_tokenizer


def train_id(prefix: str) -> str:
    return next(f"{prefix}{i}_0" for i in range(100) if not is_held_out(f"{prefix}{i}_0"))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from dspine_jax.tokenizer import TextTokenizer

    model = tmp_path_factory.mktemp("prompt_file")
    save_hf_model(model, "qwen3", tie_word_embeddings=True, vocab_size=320)
    write_tiny_tokenizer(model, vocab_size=300)
    return TextTokenizer.from_hf_folder(model)


def turns(*pairs):
    return [{"from": role, "value": text} for role, text in pairs]


def test_first_turns_first_later_turns_cut_and_read_back(tmp_path, tokenizer):
    from dspine_train.prompt_file import fitted_lines, ordered_prompts

    a, b, c = train_id("a"), train_id("b"), train_id("c")
    sharegpt = [
        {"id": a, "conversations": turns(("human", "the quick brown fox " * 8),
                                         ("gpt", "jumps over the lazy dog"),
                                         ("human", "hello world\u2028again"))},
        # opens with the assistant: its first human turn is a first turn, kept once
        {"id": b, "conversations": turns(("gpt", "hi"), ("human", "hello world"),
                                         ("gpt", "the lazy dog"), ("human", "def f(x):"))},
        {"id": c, "conversations": turns(("human", "def f(x): " * 40))},   # too long alone
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(sharegpt))

    prompts = ordered_prompts(seed=0, path=path)
    assert [p["prompt"] for p in prompts[:3]] == [
        "the quick brown fox " * 8, "hello world", "def f(x): " * 40]
    assert sorted(p["prompt"] for p in prompts[3:]) == ["def f(x):", "hello world\u2028again"]

    budget = 60
    lines, skipped = fitted_lines(tokenizer, prompts, budget)
    assert skipped == 1 and len(lines) == 4
    assert all(line.isascii() for line in lines)
    out = tmp_path / "prompts.jsonl"
    out.write_text("\n".join(lines) + "\n")
    back = jsonl_prompts(out)
    assert [p["id"] for p in back] == [p["id"] for p in prompts if p["id"] != c]
    for got, source in zip(back, [p for p in prompts if p["id"] != c]):
        ids, dropped = fit_chat(tokenizer, source["messages"], budget)
        # the line holds the turns that fit: read back, they render to the same ids
        assert got["messages"] == source["messages"][dropped:]
        assert tokenizer.encode_chat(got["messages"]) == ids and len(ids) <= budget
    cut = next(p for p in back if p["prompt"] == "hello world\u2028again")
    whole = next(p for p in back if p["prompt"] == "def f(x):")
    assert len(cut["messages"]) == 1         # the long first turn did not fit beside it
    assert len(whole["messages"]) == 3       # its context did


def test_jsonl_line_separators_inside_strings_are_not_line_ends(tmp_path):
    path = tmp_path / "p.jsonl"
    text = "one\u2028two\u0085three\x1cfour"
    path.write_text(json.dumps({"prompt": text}, ensure_ascii=False) + "\r\n"
                    + json.dumps({"prompt": "next"}) + "\n", encoding="utf-8")
    assert [p["prompt"] for p in jsonl_prompts(path)] == [text, "next"]
