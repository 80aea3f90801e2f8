"""`Pipeline.load(..., proposal=, proposal_kernel=)` (and `--proposal`, `--proposal-kernel`)
reach the engine, and every choice decodes as AR does at T = 0 (f32 on the CPU).

(The options' checks, and the CLI passing them on, are in tests/test_bad_input.py.)"""

from __future__ import annotations

import importlib

import pytest

from dspine_jax.api import Pipeline
from dspine_jax.speculative.policy import SpeculationConfig
from dspine_jax.checkpoints import load_target

PROMPTS = ["the quick brown fox", "hello world", "def f(x):"]


@pytest.fixture(scope="module")
def target_and_drafter(tiny_llama_dir, tmp_path_factory):
    from dspine_jax.drafters.checkpoint import save_drafter
    from dspine_jax.drafters.config import DrafterConfig
    from dspine_jax.drafters.model import BlockDrafter

    loaded = load_target(tiny_llama_dir, dtype="f32")
    config = DrafterConfig.for_target(loaded.config, kind="dspine", num_layers=1,
                                      mask_token_id=0, block_size=4)
    folder = tmp_path_factory.mktemp("tiny_dspine")
    save_drafter(BlockDrafter.create(config, loaded.model.output_embedding(), seed=1), folder)
    return loaded, folder


@pytest.fixture(scope="module")
def ar_tokens(target_and_drafter):
    pipe = Pipeline.from_loaded(target_and_drafter[0])
    return [r.tokens for r in pipe.generate(PROMPTS, max_new_tokens=12, ignore_eos=True)]


@pytest.mark.parametrize("proposal,kernel,runs_pallas", [
    ("sparse", "xla", False), ("sparse", "auto", False),  # auto is xla on the CPU
    ("sparse", "pallas", True), ("dense", "xla", False)])
def test_each_proposal_path_decodes_as_ar(target_and_drafter, ar_tokens, monkeypatch,
                                          proposal, kernel, runs_pallas):
    """"pallas" runs the Pallas kernel (interpret mode here); the others never reach it."""
    # (pallas_kernels exports a function named dspine_proposal, hiding the package)
    gpu = importlib.import_module("pallas_kernels.dspine_proposal.gpu")

    calls = []
    kernel_fn = gpu.vocab_top_k_gpu

    def spy(*args, **kwargs):
        calls.append(kwargs.get("interpret"))
        return kernel_fn(*args, **kwargs)

    monkeypatch.setattr(gpu, "vocab_top_k_gpu", spy)
    loaded, folder = target_and_drafter
    # fixed width: every pass drafts (adaptive may pick plain steps on the CPU)
    pipe = Pipeline.from_loaded(loaded, folder, proposal=proposal, proposal_kernel=kernel,
                                speculation=SpeculationConfig("fixed"))
    assert pipe.method == "dspine"
    assert (pipe.decoder.proposal_impl, pipe.decoder.proposal_kernel) == (proposal, kernel)
    got = [r.tokens for r in pipe.generate(PROMPTS, max_new_tokens=12, ignore_eos=True)]
    assert got == ar_tokens
    assert bool(calls) == runs_pallas and all(calls)  # traced, interpreted on the CPU


def test_the_engine_refuses_an_unknown_kernel(target_and_drafter):
    loaded, folder = target_and_drafter
    from dspine_jax.drafters.checkpoint import load_drafter
    from dspine_jax.engine import SpeculativeEngine

    drafter = load_drafter(folder, dtype=loaded.model.dtype)
    with pytest.raises(ValueError, match="proposal kernel must be one of"):
        SpeculativeEngine(loaded.model, drafter, proposal_kernel="triton")
