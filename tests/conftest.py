"""Shared fixtures: tiny random HF checkpoints built with transformers (the reference)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# dspine_torch's Triton kernels run under Triton's interpreter where there is no NVIDIA
# device; set before anything imports triton (it reads the variable on import).
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The suite compiles hundreds of programs of tiny models, each run a few times: on a
    # CPU, LLVM's optimisation of them costs more time than it saves (about a third of the
    # suite). Set before JAX starts its backend, here and in the commands tests start.
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]).strip()


@pytest.fixture(scope="session", autouse=True)
def _no_persistent_compile_cache():
    """The commands turn JAX's persistent compilation cache on for their process; in
    pytest's one process that would write every later test's programs to disk. Tests
    of the cache run the commands in a process of their own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("dspine_cli.main.use_compile_cache", lambda folder: None)
        yield


@pytest.fixture(scope="session", autouse=True)
def _session_cache_folder(tmp_path_factory):
    """One cache folder (DSPINE_CACHE_DIR) for the session, never a developer's own: the
    commands that tests start in processes of their own share JAX's compilation cache
    there, as one user's commands do."""
    with pytest.MonkeyPatch.context() as patch:
        folder = tmp_path_factory.mktemp("dspine-cache")
        patch.setenv("DSPINE_CACHE_DIR", str(folder))
        yield folder


@pytest.fixture(autouse=True)
def _fresh_speculation_state(_session_cache_folder):
    """What an engine learns there, the speculation policy's measured costs and acceptance
    keyed by device, target and drafter, would otherwise carry from one test to the next
    (tests of the same tiny random pair share a key): each test starts without it."""
    from dspine_jax.engine import speculation_folder

    shutil.rmtree(speculation_folder(), ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """After each test module, drop what it compiled: every XLA CPU executable maps its
    code into the process, and one pytest process that kept them all would pass the
    kernel's limit on memory mappings (LLVM then fails with "Cannot allocate memory")."""
    yield
    import gc
    import sys

    import jax

    # FastAPI caches what it learns of each endpoint in module-level LRU caches keyed by
    # the endpoint function; a server's endpoints close over its engine, so each app a
    # test built would keep its engine and compiled programs alive (one app per process
    # in production; dozens here)
    models = sys.modules.get("fastapi.dependencies.models")
    for name in ("_is_gen_callable_cached", "_is_async_gen_callable_cached",
                 "_is_coroutine_callable_cached"):
        getattr(getattr(models, name, None), "cache_clear", lambda: None)()
    gc.collect()            # decoders (and their compiled calls) of the module's fixtures
    jax.clear_caches()


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2)


def hf_config(family: str, **overrides):
    import transformers

    kw = {**TINY, **overrides}
    if family == "qwen3":
        kw.setdefault("rope_theta", 1e6)
        return transformers.Qwen3Config(**kw)
    kw.setdefault("rope_theta", 1e5)
    return transformers.LlamaConfig(**kw)


def save_hf_model(folder: Path, family: str, seed: int = 0, max_shard_size=None, **overrides):
    """A random transformers model saved as an HF folder; returns the torch model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = hf_config(family, **overrides)
    cls = transformers.Qwen3ForCausalLM if family == "qwen3" else transformers.LlamaForCausalLM
    model = cls(config).float().eval()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kwargs)
    return model


def write_tiny_tokenizer(folder: Path, vocab_size: int = 128) -> None:
    """A byte-level BPE trained on a few sentences, with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world", "def f(x):"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast"}))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint folder with tokenizer and chat template."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    # A byte-level tokenizer needs 256 byte tokens before any merge.
    save_hf_model(folder, "llama", tie_word_embeddings=True, vocab_size=320)
    write_tiny_tokenizer(folder, vocab_size=300)
    return folder


@pytest.fixture(scope="session")
def tiny_dspine_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """A random one-layer DSpine drafter (block 4) for the tiny Llama, saved as a folder."""
    from dspine_jax.checkpoints import load_target
    from dspine_jax.drafters.checkpoint import save_drafter
    from dspine_jax.drafters.config import DrafterConfig
    from dspine_jax.drafters.model import BlockDrafter

    loaded = load_target(tiny_llama_dir, dtype="f32")
    config = DrafterConfig.for_target(loaded.config, kind="dspine", num_layers=1,
                                      mask_token_id=0, block_size=4)
    folder = tmp_path_factory.mktemp("tiny_dspine")
    save_drafter(BlockDrafter.create(config, loaded.model.output_embedding(), seed=1), folder)
    return folder


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from dspine_jax.registry import resolve_target

    return resolve_target("smollm2-135m-instruct")
