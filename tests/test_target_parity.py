"""The JAX target equals transformers' PyTorch model on the same weights."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dspine_jax.checkpoints import load_target, save_target
from dspine_jax.config import TargetConfig
from dspine_jax.rope import rope_frequencies
from tests.conftest import hf_config, save_hf_model

CASES = {
    "qwen3-gqa-untied": ("qwen3", dict(tie_word_embeddings=False)),
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True)),
    "qwen3-mha-yarn": ("qwen3", dict(num_key_value_heads=4, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    "llama-gqa-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-untied-bias": ("llama", dict(tie_word_embeddings=False, attention_bias=True,
                                        mlp_bias=True)),
    "llama-llama3-rope": ("llama", dict(tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
    family, overrides = CASES[case]
    ref = save_hf_model(tmp_path, family, **overrides)
    loaded = load_target(tmp_path, dtype="f32", with_tokenizer=False)
    assert loaded.config.family == family
    tokens = np.random.default_rng(0).integers(0, 128, size=(2, 100))  # past yarn/llama3's
    ours = loaded.model(jnp.asarray(tokens)).logits                      # original context
    assert rel_err(ours, torch_logits(ref, tokens)) <= 1e-4


def test_sharded_checkpoint_loads(tmp_path):
    ref = save_hf_model(tmp_path, "qwen3", max_shard_size="40KB", tie_word_embeddings=False)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = load_target(tmp_path, dtype="f32", with_tokenizer=False)
    tokens = np.arange(24)[None] % 128
    assert rel_err(loaded.model(jnp.asarray(tokens)).logits, torch_logits(ref, tokens)) <= 1e-4


@pytest.mark.parametrize("family,tied", [("qwen3", False), ("llama", True)])
def test_saved_checkpoint_reloads_in_transformers(tmp_path, family, tied):
    import transformers

    save_hf_model(tmp_path / "src", family, tie_word_embeddings=tied)
    ours = load_target(tmp_path / "src", dtype="f32", with_tokenizer=False).model
    save_target(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    tokens = np.arange(40)[None] % 128
    assert rel_err(ours(jnp.asarray(tokens)).logits, torch_logits(back, tokens)) <= 1e-4
    again = load_target(tmp_path / "out", dtype="f32", with_tokenizer=False).model
    np.testing.assert_array_equal(ours(jnp.asarray(tokens)).logits,
                                  again(jnp.asarray(tokens)).logits)


@pytest.mark.parametrize("case", ["qwen3-mha-yarn", "llama-llama3-rope", "qwen3-tied"])
def test_rope_frequencies_match_transformers(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    family, overrides = CASES[case]
    hf = hf_config(family, **overrides)
    ours = TargetConfig.from_hf(hf.to_dict())
    inv_freq, scale = rope_frequencies(ours)
    kind = ours.rope_scaling_dict.get("rope_type", "default")
    if kind == "default":
        ref = 1.0 / hf.rope_parameters["rope_theta"] ** (np.arange(0, 16, 2) / 16)
        ref_scale = 1.0
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
        ref = ref.numpy()
    np.testing.assert_allclose(inv_freq, ref, rtol=1e-6)
    assert scale == pytest.approx(ref_scale)


def test_hidden_states_are_layer_outputs(tmp_path):
    """hidden_states[j] is the output of decoder layer hidden_layer_ids[j] (HF's
    hidden_states[id + 1]); HF's last entry has the final norm applied."""
    ref = save_hf_model(tmp_path, "qwen3", num_hidden_layers=3)
    model = load_target(tmp_path, dtype="f32", with_tokenizer=False).model
    tokens = np.arange(20)[None]
    out = model(jnp.asarray(tokens), hidden_layer_ids=(2, 0, 1))
    with torch.no_grad():
        hs = ref(torch.as_tensor(tokens), output_hidden_states=True).hidden_states
    assert rel_err(out.hidden_states[1], hs[1].numpy()) <= 1e-5
    assert rel_err(out.hidden_states[2], hs[2].numpy()) <= 1e-5
    assert rel_err(model.norm(out.hidden_states[0]), hs[3].numpy()) <= 1e-5
    assert rel_err(out.final_hidden, hs[3].numpy()) <= 1e-5
