"""Tokenizer and chat template from an HF folder; `dspine generate` end to end on it."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from typer.testing import CliRunner

from dspine_cli.main import app
from dspine_jax.checkpoints import load_target
from dspine_jax.tokenizer import TextTokenizer
from dspine_jax.runtime.offline import generate_tokens

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
    expected = generate_tokens(AutoregressiveGenerator(loaded.model),
        [ids], max_new_tokens=7).generations[0].tokens
    assert out["tokens"] == expected and out["num_tokens"] == 7
    assert out["text"] == tok.decode(expected)
    assert out["prompt_tokens"] == len(ids)


def test_cli_streams_text(tiny_llama_dir):
    result = CliRunner().invoke(app, ["generate", "--target", str(tiny_llama_dir), "--prompt",
                                      "hello", "-n", "5", "--ignore-eos", "--temperature",
                                      "0.8", "--top-k", "20", "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert "5 tokens in" in result.stderr
    # Plain text shows no finish_reason: the summary says the budget cut the text.
    assert "stopped at --max-new-tokens 5]" in result.stderr


def test_summary_line_says_why_generation_stopped():
    from dspine_jax.api import Result
    from dspine_cli.main import summary_line

    result = Result(text="x", tokens=[1, 2, 3], prompt_tokens=2, finish_reason="stop",
                    accept_lengths=[2], seconds=1.0, compile_seconds=0.0, batch_size=1,
                    verify_widths={15: 1})
    assert "stopped" not in summary_line("dspine", result, 3)
    assert "mean acceptance length 2.00 (passes: 1 at width 15)" in summary_line(
        "dspine", result, 3)
    cut = dataclasses.replace(result, finish_reason="length")
    assert summary_line("ar", cut, 3).endswith("; stopped at --max-new-tokens 3]")


def test_cli_plain_text_prompts_file_names_prompts_cut_short(tiny_llama_dir, tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "hello"}\n{"prompt": "the quick"}\n')
    result = CliRunner().invoke(app, ["generate", "--target", str(tiny_llama_dir),
                                      "--prompts-file", str(tmp_path / "p.jsonl"), "-n", "3",
                                      "--ignore-eos"])
    assert result.exit_code == 0, result.output
    assert "[2 of 2 prompts stopped at --max-new-tokens 3: prompts 1, 2]" in result.stderr


def test_mean_accept_length_has_one_definition(tiny_llama_dir):
    """A generation with no verify pass (max_new_tokens=1: prefill's token only) reports the
    same value through the decoder, the API and `--json` (it was 0.0 in one, 1.0 in the
    other), and a pass-by-pass mean otherwise."""
    from dspine_jax.api import Pipeline
    from dspine_jax.decoding import mean_accept_length

    pipe = Pipeline.load(tiny_llama_dir)
    ids = pipe.encode("hello")
    [g] = generate_tokens(pipe.decoder, [ids], max_new_tokens=1).generations
    [r] = pipe.generate(["hello"], max_new_tokens=1)
    assert g.accept_lengths == r.accept_lengths == []
    assert g.mean_accept_length == r.mean_accept_length == 0.0
    assert r.to_json("ar")["mean_accept_length"] == 0.0
    [r] = pipe.generate(["hello"], max_new_tokens=4, ignore_eos=True)
    assert r.accept_lengths == [1, 1, 1] and r.mean_accept_length == 1.0  # AR: one per pass
    assert mean_accept_length([1, 3, 2]) == 2.0 and mean_accept_length([]) == 0.0


@pytest.fixture(scope="module")
def tiny_drafters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafters")
    for kind in ("dflash", "dspine"):
        result = CliRunner().invoke(app, [
            "init-drafter", "--target", str(tiny_llama_dir), "--kind", kind, "--layers", "1",
            "--block-size", "4", "--mask-token-id", "5", "--out", str(root / kind)])
        assert result.exit_code == 0, result.output
    return root


@pytest.mark.parametrize("kind,method", [("dflash", ["--method", "dflash"]),
                                         ("dspine", [])])  # no --method: the drafter's kind
def test_cli_speculative_prompts_file_equals_ar(tiny_llama_dir, tiny_drafters, tmp_path, kind,
                                                method):
    lines = ['{"prompt": "hello world", "chat": true}', '{"prompt": "the quick brown fox"}',
             '', '{"prompt": "def f(x):", "chat": false}']
    (tmp_path / "p.jsonl").write_text("\n".join(lines))
    common = ["generate", "--target", str(tiny_llama_dir), "--prompts-file",
              str(tmp_path / "p.jsonl"), "-n", "9", "--json", "--ignore-eos", "--batch-size", "2"]
    ar = CliRunner().invoke(app, common)
    spec = CliRunner().invoke(app, common + method + ["--drafter", str(tiny_drafters / kind)])
    assert ar.exit_code == 0 and spec.exit_code == 0, spec.output
    ar_rows = [json.loads(x) for x in ar.stdout.strip().splitlines()]
    spec_rows = [json.loads(x) for x in spec.stdout.strip().splitlines()]
    assert len(spec_rows) == 3
    for a, s in zip(ar_rows, spec_rows):
        assert s["tokens"] == a["tokens"] and s["method"] == kind
        assert sum(s["accept_lengths"]) == s["num_tokens"] - 1
        assert s["mean_accept_length"] >= 1 and s["tokens_per_second"] > 0


@pytest.mark.parametrize("content,message", [
    ('{"prompt": "a"}\nnot json', "p.jsonl:2: not valid JSON"),
    ('{"text": "a"}', 'p.jsonl:1: expected an object with a string "prompt"'),
    ('{"prompt": "a", "chat": "yes"}', 'p.jsonl:1: "chat" must be true or false'),
    ("", "p.jsonl: no prompts")])
def test_cli_bad_prompts_file(tiny_llama_dir, tmp_path, content, message):
    (tmp_path / "p.jsonl").write_text(content)
    result = CliRunner().invoke(app, ["generate", "--target", str(tiny_llama_dir),
                                      "--prompts-file", str(tmp_path / "p.jsonl")])
    assert result.exit_code == 2 and message in result.output


def test_cli_method_and_drafter_must_match(tiny_llama_dir, tiny_drafters):
    result = CliRunner().invoke(app, ["generate", "--target", str(tiny_llama_dir), "-p", "hi",
                                      "--method", "dflash", "--drafter",
                                      str(tiny_drafters / "dspine")])
    assert result.exit_code == 2 and "is a dspine drafter" in result.output
    result = CliRunner().invoke(app, ["generate", "--target", str(tiny_llama_dir), "-p", "hi",
                                      "--method", "beam"])
    assert result.exit_code == 2 and "method must be one of ar, dflash, dspine" in result.output


def test_cli_method_ar_with_a_drafter_is_an_error(tiny_llama_dir, tiny_drafters):
    result = CliRunner().invoke(app, ["generate", "--target", str(tiny_llama_dir), "-p", "hi",
                                      "--method", "ar", "--drafter",
                                      str(tiny_drafters / "dspine")])
    assert result.exit_code == 2 and "--method ar decodes without a drafter" in result.output


def test_exported_files_get_normal_permissions(tiny_llama_dir, tiny_drafters, tmp_path):
    """safetensors writes through a 0600 temp file; an export must be readable by others."""
    old = os.umask(0o022)
    try:
        result = CliRunner().invoke(app, ["export", "--drafter", str(tiny_drafters / "dspine"),
                                          "--target", str(tiny_llama_dir), "--out",
                                          str(tmp_path / "export")])
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    # The weights, the config and the modeling code shipped for trust_remote_code; no
    # temporary file left behind, every file readable by others.
    expected = ["config.json", "configuration_dspine.py", "model.safetensors",
                "modeling_dspine.py"]
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == expected
    for name in expected:
        assert (tmp_path / "export" / name).stat().st_mode & 0o777 == 0o644, name
