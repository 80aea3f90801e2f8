"""Bad input gets an error that names the problem; nothing is silently truncated."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from dspine_jax.checkpoints import load_target
from dspine_jax.errors import CheckpointError, ConfigError, InputError
from dspine_jax.generate import AutoregressiveGenerator
from tests.conftest import save_hf_model


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen")
    save_hf_model(folder, "qwen3", tie_word_embeddings=False)
    return folder


def copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_missing_path():
    with pytest.raises(CheckpointError, match="neither a built-in name nor|nor an existing path"):
        load_target("/definitely/not/here")


def test_folder_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_target(tmp_path)


def test_folder_without_weights(qwen_dir, tmp_path):
    folder = copy(qwen_dir, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_target(folder, with_tokenizer=False)


def test_unknown_architecture(qwen_dir, tmp_path):
    folder = copy(qwen_dir, tmp_path)
    edit_config(folder, architectures=["MambaForCausalLM"], model_type="mamba")
    with pytest.raises(ConfigError, match="unknown architecture.*MambaForCausalLM"):
        load_target(folder, with_tokenizer=False)


def test_config_with_more_layers_than_weights(qwen_dir, tmp_path):
    folder = copy(qwen_dir, tmp_path)
    edit_config(folder, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match="Missing tensors: model.layers.2"):
        load_target(folder, with_tokenizer=False)


def test_config_with_wrong_mlp_width(qwen_dir, tmp_path):
    folder = copy(qwen_dir, tmp_path)
    edit_config(folder, intermediate_size=128)
    with pytest.raises(CheckpointError,
                       match=r"tensor model.layers.0.mlp.\w+_proj.weight has shape \(\d+, \d+\) "
                             r"but the config implies"):
        load_target(folder, with_tokenizer=False)


def test_config_says_tied_but_lm_head_missing(qwen_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = copy(qwen_dir, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="tie_word_embeddings=false"):
        load_target(folder, with_tokenizer=False)


def test_corrupt_safetensors(qwen_dir, tmp_path):
    folder = copy(qwen_dir, tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_target(folder, with_tokenizer=False)


def test_nan_weights_are_refused(qwen_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = copy(qwen_dir, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"][3] = np.nan
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.norm.weight holds NaN"):
        load_target(folder, with_tokenizer=False)


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(CheckpointError, match="corrupt or unsupported GGUF"):
        load_target(bad)


def test_prompt_past_the_context(qwen_dir):
    model = load_target(qwen_dir, with_tokenizer=False).model  # context 256
    gen = AutoregressiveGenerator(model)
    with pytest.raises(InputError, match="prompt 0 has 250 tokens.*past the model's context of 256"):
        gen.generate([[1] * 250], max_new_tokens=10)
    with pytest.raises(InputError, match="outside the vocabulary"):
        gen.generate([[1, 500]], max_new_tokens=2)
    with pytest.raises(InputError, match="empty"):
        gen.generate([[]], max_new_tokens=2)


def test_cli_reports_errors_without_traceback(tmp_path):
    from typer.testing import CliRunner

    from dspine_jax.cli import app

    result = CliRunner().invoke(app, ["generate", "--prompt", "hi", "--target", str(tmp_path)])
    assert result.exit_code == 2
    assert "error:" in result.output and "no config.json" in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(app, ["generate", "--prompt", "hi", "--top-p", "0"])
    assert result.exit_code == 2 and "top_p must be in (0, 1]" in result.output
