"""SmolLM2-135M-Instruct from its GGUF: logits, greedy text, tokenizer and chat template
agree with transformers' own GGUF load."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dspine_jax.checkpoints import load_target
from dspine_jax.generate import AutoregressiveGenerator
from dspine_jax.runtime.offline import generate_tokens

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "Photosynthesis is the process by which"]
TEXTS = PROMPTS + ["Hello 12345 world!\n\n  indented\ttab", "naïve café — 日本語 🙂",
                   "<|im_start|>user\nhi<|im_end|>", "   leading spaces", "x=1;y=2\r\n"]
CHATS = [[{"role": "user", "content": "What is 2+2?"}],
         [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]]


@pytest.fixture(scope="module")
def ours(smollm2_path):
    return load_target(smollm2_path, dtype="f32")


@pytest.fixture(scope="module")
def reference(smollm2_path):
    import transformers

    kw = dict(gguf_file=smollm2_path.name)
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_path.parent, **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, dtype=torch.float32, **kw).eval()
    return tok, model


def test_config_read_from_gguf(ours):
    c = ours.config
    assert (c.family, c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim, c.intermediate_size, c.vocab_size) == \
        ("llama", 30, 576, 9, 3, 64, 1536, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 1e5


def test_tokenizer_matches_transformers(ours, reference):
    tok, _ = reference
    for text in TEXTS:
        assert ours.tokenizer.encode(text) == tok(text).input_ids, text
        ids = tok(text).input_ids
        assert ours.tokenizer.decode(ids, skip_special_tokens=False) == tok.decode(ids)


def test_chat_template_matches_transformers(ours, reference):
    tok, _ = reference
    for messages in CHATS:
        expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.tokenizer.render_chat(messages) == expected
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert ours.tokenizer.encode_chat(messages) == list(ids)


def test_logits_match_transformers(ours, reference):
    tok, model = reference
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits.numpy()
        got = np.asarray(ours.model(jnp.asarray([ids])).logits)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= 1e-4


def test_greedy_continuations_match_transformers(ours, reference):
    tok, model = reference
    prompts = [tok(p).input_ids for p in PROMPTS]
    prompts.append(ours.tokenizer.encode_chat(CHATS[0]))
    gen = AutoregressiveGenerator(ours.model, eos_token_ids=ours.tokenizer.eos_token_ids)
    batch = generate_tokens(gen, prompts, max_new_tokens=24)
    for ids, got in zip(prompts, batch.generations):
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                 eos_token_id=list(ours.tokenizer.eos_token_ids),
                                 pad_token_id=tok.pad_token_id)
        expected = ref[0, len(ids):].tolist()
        assert got.tokens == expected


def test_cli_generate_json(smollm2_path):
    from typer.testing import CliRunner

    from dspine_cli.main import app

    result = CliRunner().invoke(app, ["generate", "--prompt", "The capital of France is",
                                      "--max-new-tokens", "6", "--json", "--dtype", "f32"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["num_tokens"] == len(out["tokens"]) == 6
    assert out["tokens"][0] == 7042 and "Paris" in out["text"]  # " Paris"
    assert out["seconds"] > 0


@pytest.mark.parametrize("kind", ["dflash", "dspine"])
def test_speculative_greedy_equals_ar_with_an_untrained_drafter(ours, kind):
    """Losslessness cannot depend on drafter quality."""
    from dspine_jax.drafters.config import DrafterConfig, mask_token_for
    from dspine_jax.drafters.model import BlockDrafter
    from dspine_jax.engine import SpeculativeEngine

    config = DrafterConfig.for_target(ours.config, kind=kind, num_layers=2,
                                      mask_token_id=mask_token_for(ours.tokenizer))
    drafter = BlockDrafter.create(config, ours.model.output_embedding(), seed=0)
    eos = ours.tokenizer.eos_token_ids
    prompts = [ours.tokenizer.encode(PROMPTS[0]), ours.tokenizer.encode_chat(CHATS[0])]
    want = generate_tokens(AutoregressiveGenerator(ours.model, eos_token_ids=eos),
        prompts, max_new_tokens=20)
    got = generate_tokens(SpeculativeEngine(ours.model, drafter, eos_token_ids=eos),
        prompts, max_new_tokens=20)
    for w, g in zip(want.generations, got.generations):
        assert g.tokens == w.tokens


def test_the_readme_parity_check_runs_on_the_builtin_pair(tmp_path):
    """The README's `dspine parity` line on the built-in target and DSpine drafter (the
    PyTorch side reads the GGUF with transformers), on one of its default prompts and 8
    new tokens instead of three and 32 (minutes on 2 cores)."""
    import shlex
    from pathlib import Path

    from typer.testing import CliRunner

    from dspine_cli.main import app
    from dspine_jax.parity import DEFAULT_TEXTS

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    [line] = [ln for ln in readme.splitlines()
              if ln.startswith("dspine parity --target smollm2-135m-instruct")]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": DEFAULT_TEXTS[0]}) + "\n")
    args = shlex.split(line)[1:] + ["--prompts", str(prompts), "--max-new-tokens", "8"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "transition" in result.output and "all stages within tolerance" in result.output


def test_decode_complete_drops_a_cut_character(ours):
    """SmolLM2's tokens for "日本語 🙂" end inside 日 and inside 語 on the way: cut there,
    the text ends on the last whole character; a U+FFFD of its own stays."""
    tok = ours.tokenizer
    ids = tok.encode("日本語 🙂")
    assert [tok.decode(ids[:n]).endswith("\ufffd") for n in range(1, 8)] == \
        [True, False, False, True, True, False, False]
    assert [tok.decode_complete(ids[:n]) for n in range(1, 8)] == \
        ["", "日", "日本", "日本", "日本", "日本語", "日本語 🙂"]
    assert tok.decode_complete(tok.encode("a\ufffd")) == "a\ufffd"
