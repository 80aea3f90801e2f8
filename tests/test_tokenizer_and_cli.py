"""Tokenizer and chat template from an HF folder; `dspine generate` end to end on it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dspine_jax.cli import app
from dspine_jax.checkpoints import load_target
from dspine_jax.tokenizer import TextTokenizer

TEXTS = ["the quick brown fox", "hello world!", "def f(x):\n  return x", "<|im_start|>hi"]


def test_hf_folder_tokenizer_matches_transformers(tiny_llama_dir):
    import transformers

    ref = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    ours = TextTokenizer.from_hf_folder(tiny_llama_dir)
    for text in TEXTS:
        assert ours.encode(text) == ref(text).input_ids
    messages = [{"role": "user", "content": "hello world"}]
    assert ours.render_chat(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert ours.eos_token_ids == (ref.convert_tokens_to_ids("<|im_end|>"),)


def test_chat_without_template_is_an_error(tiny_llama_dir, tmp_path):
    import shutil

    folder = tmp_path / "plain"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "tokenizer_config.json").write_text("{}")
    result = CliRunner().invoke(app, ["generate", "--target", str(folder), "--prompt", "hi",
                                      "--chat", "-n", "2"])
    assert result.exit_code == 2 and "no chat template" in result.output


@pytest.mark.parametrize("chat", [False, True])
def test_cli_json_equals_library_greedy(tiny_llama_dir, chat):
    from dspine_jax.generate import AutoregressiveGenerator

    args = ["generate", "--target", str(tiny_llama_dir), "--prompt", "hello world",
            "--max-new-tokens", "7", "--ignore-eos", "--json"] + (["--chat"] if chat else [])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    loaded = load_target(tiny_llama_dir)
    tok = loaded.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "hello world"}]) if chat \
        else tok.encode("hello world")
    expected = AutoregressiveGenerator(loaded.model).generate(
        [ids], max_new_tokens=7).generations[0].tokens
    assert out["tokens"] == expected and out["num_tokens"] == 7
    assert out["text"] == tok.decode(expected)
    assert out["prompt_tokens"] == len(ids)


def test_cli_streams_text(tiny_llama_dir):
    result = CliRunner().invoke(app, ["generate", "--target", str(tiny_llama_dir), "--prompt",
                                      "hello", "-n", "5", "--ignore-eos", "--temperature",
                                      "0.8", "--top-k", "20", "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert "5 tokens in" in result.output
