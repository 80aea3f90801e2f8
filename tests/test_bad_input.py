"""Bad input gets an error that names the problem; nothing is silently truncated."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from dspine_jax.checkpoints import load_target
from dspine_jax.errors import CheckpointError, ConfigError, InputError
from dspine_jax.generate import AutoregressiveGenerator
from dspine_jax.runtime.offline import generate_tokens
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
    with pytest.raises(InputError,
                       match="prompt 0: the prompt has 250 tokens.*past the engine's "
                             "context of 256 \\(the model's\\)"):
        generate_tokens(gen, [[1] * 250], max_new_tokens=10)
    with pytest.raises(InputError, match="outside the vocabulary"):
        generate_tokens(gen, [[1, 500]], max_new_tokens=2)
    with pytest.raises(InputError, match="empty"):
        generate_tokens(gen, [[]], max_new_tokens=2)


def test_cli_reports_errors_without_traceback(tmp_path):
    from typer.testing import CliRunner

    from dspine_cli.main import app

    result = CliRunner().invoke(app, ["generate", "--prompt", "hi", "--target", str(tmp_path)])
    assert result.exit_code == 2
    assert "error:" in result.output and "no config.json" in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(app, ["generate", "--prompt", "hi", "--top-p", "0"])
    assert result.exit_code == 2 and "top_p must be in (0, 1]" in result.output


# ----- requests that fail before the target loads --------------------------------------

@pytest.fixture
def loads_nothing(monkeypatch):
    """Make any target load an error: a request that reaches it was not checked first."""
    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the request was checked")

    monkeypatch.setattr("dspine_jax.api.load_target", refuse)
    monkeypatch.setattr("dspine_jax.evaluation.run.load_target", refuse)


def weightless_drafter(tmp_path):
    folder = tmp_path / "weightless"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


@pytest.mark.parametrize("args,message", [
    (["--method", "ar", "--drafter", "/random/dir"], "--method ar decodes without a drafter"),
    (["--drafter", "/random/dir"], "'/random/dir' is neither a built-in name"),
    (["--drafter", "{tmp}"], "has no config.json"),
    (["--drafter", "{weightless}"], "has no model.safetensors"),
    (["--method", "beam"], "method must be one of ar, dflash, dspine; got 'beam'"),
    (["--method", "dspine", "--drafter", "smollm2-135m-instruct-dflash"],
     "--method dspine but the drafter at smollm2-135m-instruct-dflash is a dflash drafter"),
    (["--target", "{tmp}", "--method", "dspine"], "--method dspine needs --drafter"),
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt", " \n "], "--prompt is empty"),
    (["--prompts-file", "{tmp}/missing.jsonl"], "missing.jsonl: no such prompts file"),
    (["--prompts-file", "{empty_prompt}"], "p.jsonl: empty prompt (id or line 2)"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--dtype", "f16"], "dtype must be one of auto"),
    (["--attention-backend", "flash"],
     "attention backend must be one of auto, pallas, xla; got 'flash'"),
    (["--method", "ar", "--proposal", "dense"],
     "--proposal dense: how a drafter proposes, but the method is ar"),
    (["--method", "dspine", "--proposal", "dense", "--proposal-kernel", "pallas"],
     "--proposal-kernel pallas is the kernel of the sparse proposal; --proposal dense has none"),
])
def test_generate_checks_before_loading(loads_nothing, tmp_path, args, message):
    from typer.testing import CliRunner

    from dspine_cli.main import app

    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"prompt": ""}\n')
    fill = {"tmp": str(tmp_path), "weightless": str(weightless_drafter(tmp_path)),
            "empty_prompt": str(tmp_path / "p.jsonl")}
    args = [a.format(**fill) for a in args]
    if "--prompt" not in args and "--prompts-file" not in args:
        args += ["--prompt", "hi"]
    result = CliRunner().invoke(app, ["generate", *args])
    assert result.exit_code == 2, result.output  # 1 would be the loader's AssertionError
    assert "error: " in result.output and message in result.output
    assert "Traceback" not in result.output


def test_pipeline_load_checks_before_loading(loads_nothing):
    from dspine_jax.api import Pipeline

    with pytest.raises(InputError, match="--method ar decodes without a drafter"):
        Pipeline.load(drafter="smollm2-135m-instruct-dspine", method="ar")
    with pytest.raises(ConfigError, match="is a dspine drafter"):
        Pipeline.load(drafter="smollm2-135m-instruct-dspine", method="dflash")
    with pytest.raises(CheckpointError, match="neither a built-in name"):
        Pipeline.load(drafter="/random/dir")
    with pytest.raises(InputError, match="--proposal must be one of sparse, dense; got 'fast'"):
        Pipeline.load(drafter="smollm2-135m-instruct-dspine", proposal="fast")
    with pytest.raises(InputError, match="--proposal-kernel must be one of auto, xla, pallas"):
        Pipeline.load(drafter="smollm2-135m-instruct-dspine", proposal_kernel="pallas_gpu")
    with pytest.raises(InputError, match="--proposal-kernel pallas: .* the method is ar"):
        Pipeline.load(proposal_kernel="pallas")


# The proposal options of every command that decodes: a bad value names the option and
# what it takes; a proposal with nothing to propose (no drafter: AR) is refused.
PROPOSAL_COMMANDS = {"generate": ["generate", "--prompt", "hi"],
                     "serve": ["serve", "--port", "0"],           # any free port
                     "eval": ["eval", "--benchmarks", "mtbench", "--out", "{tmp}/eval"]}


@pytest.mark.parametrize("command", PROPOSAL_COMMANDS)
@pytest.mark.parametrize("args,message", [
    (["--proposal", "fast"], "--proposal must be one of sparse, dense; got 'fast'"),
    (["--proposal-kernel", "triton"],
     "--proposal-kernel must be one of auto, xla, pallas; got 'triton'"),
    (["--proposal", "dense"], "--proposal dense: how a drafter proposes, but the method is ar"),
    (["--proposal-kernel", "auto"],
     "--proposal-kernel auto: how a drafter proposes, but the method is ar"),
])
def test_proposal_options_are_checked_before_loading(loads_nothing, tmp_path, command, args,
                                                     message):
    from typer.testing import CliRunner

    from dspine_cli.main import app

    line = [a.format(tmp=tmp_path) for a in PROPOSAL_COMMANDS[command]] + args
    result = CliRunner().invoke(app, line)
    assert result.exit_code == 2, result.output  # 1 would be the loader's AssertionError
    assert "error: " in result.output and message in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", PROPOSAL_COMMANDS)
def test_proposal_options_reach_the_pipeline(monkeypatch, tmp_path, command):
    """What the command passes on, stopped where the target would load."""
    from typer.testing import CliRunner

    from dspine_cli.main import app

    seen = {}

    def stop(*args, **kwargs):
        seen.update(kwargs)
        raise InputError("stopped before loading")

    monkeypatch.setattr("dspine_jax.api.Pipeline.load", stop)
    monkeypatch.setattr("dspine_jax.api.Pipeline.from_choice", stop)     # serve's load
    monkeypatch.setattr("dspine_jax.api.load_target", lambda *a, **k: None)
    monkeypatch.setattr("dspine_jax.evaluation.run.evaluate", stop)
    line = [a.format(tmp=tmp_path) for a in PROPOSAL_COMMANDS[command]]
    drafter = ["--drafter", "smollm2-135m-instruct-dspine"]
    for extra, want in (([], ("sparse", "xla")),
                        (["--proposal", "dense"], ("dense", "xla")),
                        (["--proposal-kernel", "pallas"], ("sparse", "pallas"))):
        seen.clear()
        result = CliRunner().invoke(app, line + drafter + extra)
        assert "stopped before loading" in result.output, result.output
        assert (seen["proposal"], seen["proposal_kernel"]) == want


def test_pallas_backend_names_the_head_dims_it_supports(tiny_llama_dir):
    """The tiny Llama's head dim 16 is not one the paged-attention kernel runs."""
    from typer.testing import CliRunner

    from dspine_cli.main import app

    result = CliRunner().invoke(app, ["generate", "--target", str(tiny_llama_dir), "-p", "hi",
                                      "-n", "2", "--attention-backend", "pallas"])
    assert result.exit_code == 2, result.output
    assert "does not support head dim 16 (supported: 64, 128)" in result.output
    assert "--attention-backend xla" in result.output and "Traceback" not in result.output


def test_method_is_whatever_the_drafter_is():
    from dspine_jax.api import resolve_method
    from dspine_jax.registry import resolve_drafter

    target = "smollm2-135m-instruct"
    assert resolve_method(target, None, None).method == "ar"
    assert resolve_method(target, None, "ar").drafter is None
    for kind in ("dflash", "dspine"):
        builtin = resolve_drafter(f"{target}-{kind}")
        assert resolve_method(target, None, kind).drafter == builtin  # built-in by method
        assert resolve_method(target, f"{target}-{kind}", None).method == kind  # by drafter
        assert resolve_method(None, builtin, kind).method == kind
    with pytest.raises(InputError, match="needs --drafter"):
        resolve_method(None, None, "dspine")  # a loaded target has no built-in drafter


@pytest.mark.parametrize("args,message", [
    (["--drafter", "/random/dir"], "'/random/dir' is neither a built-in name"),
    (["--drafter", "{weightless}"], "has no model.safetensors"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--dtype", "f16"], "dtype must be one of auto"),
    (["--attention-backend", "flash"], "attention backend must be one of auto, pallas, xla"),
])
def test_eval_checks_before_loading(loads_nothing, tmp_path, args, message):
    from typer.testing import CliRunner

    from dspine_cli.main import app

    weightless = weightless_drafter(tmp_path)
    args = [a.format(weightless=weightless) for a in args]
    result = CliRunner().invoke(app, ["eval", "--benchmarks", "mtbench", "--out",
                                      str(tmp_path / "eval"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "eval").exists()  # nothing made for a refused request


def test_eval_refuses_a_folder_with_results(loads_nothing, tmp_path):
    from typer.testing import CliRunner

    from dspine_cli.main import app

    (tmp_path / "results.json").write_text('{"earlier": "run"}')
    result = CliRunner().invoke(app, ["eval", "--benchmarks", "mtbench", "--out",
                                      str(tmp_path)])
    assert result.exit_code == 2
    assert "already holds results of an earlier run (results.json)" in result.output
    assert "pass a new folder" in result.output
    assert (tmp_path / "results.json").read_text() == '{"earlier": "run"}'


# ----- GGUF files cut short ----------------------------------------------------------------

def write_tiny_gguf(path):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_token_list([f"t{i}" for i in range(50)])
    writer.add_tensor("token_embd.weight", np.arange(50 * 8, dtype=np.float32).reshape(50, 8))
    writer.add_tensor("output_norm.weight", np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.stat().st_size


@pytest.mark.parametrize("keep,message", [
    (-1, "truncated: {n} of {size} bytes"),   # the last tensor's last byte missing
    (-1000, "truncated: {n} of {size} bytes"),  # inside the first tensor's data
    (100, "truncated: 100 of at least"),      # inside the token list: header cut short
    (0, "truncated: 0 bytes"),
])
def test_truncated_gguf_names_both_sizes(tmp_path, keep, message):
    from dspine_jax.checkpoints.gguf_file import GGUFCheckpoint

    size = write_tiny_gguf(tmp_path / "full.gguf")
    GGUFCheckpoint(tmp_path / "full.gguf")  # the whole file opens
    data = (tmp_path / "full.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep])
    n = cut.stat().st_size
    with pytest.raises(CheckpointError) as error:
        GGUFCheckpoint(cut)
    assert str(error.value).startswith(f"{cut}: ")
    assert message.format(n=n, size=size) in str(error.value)


@pytest.mark.slow
def test_truncated_smollm2_gguf(smollm2_path, tmp_path):
    cut = tmp_path / "smollm2.gguf"
    with open(smollm2_path, "rb") as f:
        cut.write_bytes(f.read(5_000_000))
    with pytest.raises(CheckpointError,
                       match=f"truncated: 5000000 of {smollm2_path.stat().st_size} bytes"):
        load_target(cut)


# --speculation and --max-verify-width on every command that decodes: a bad value, a width
# past the drafter's block and a setting with no drafter are one line each, before loading.
DSPINE = ["--drafter", "smollm2-135m-instruct-dspine"]


@pytest.mark.parametrize("command", PROPOSAL_COMMANDS)
@pytest.mark.parametrize("args,message", [
    (DSPINE + ["--speculation", "sometimes"],
     "--speculation must be one of adaptive, fixed, off; got 'sometimes'"),
    (DSPINE + ["--speculation", "fixed", "--max-verify-width", "0"],
     "--max-verify-width 0 with --speculation fixed verifies no draft"),
    (DSPINE + ["--max-verify-width", "16"],
     "--max-verify-width 16 is more than the drafter drafts: its block of 16 tokens holds 15"),
    (["--speculation", "fixed"], "--speculation and --max-verify-width set how many drafted"),
])
def test_speculation_options_are_checked_before_loading(loads_nothing, tmp_path, command,
                                                        args, message):
    from typer.testing import CliRunner

    from dspine_cli.main import app

    line = [a.format(tmp=tmp_path) for a in PROPOSAL_COMMANDS[command]] + args
    result = CliRunner().invoke(app, line)
    assert result.exit_code == 2, result.output
    assert "error: " in result.output and message in result.output
    assert "Traceback" not in result.output


def test_a_busy_port_is_an_error_before_loading(loads_nothing):
    import socket

    from typer.testing import CliRunner

    from dspine_cli.main import app

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, ["serve", "--port", str(port)])
    assert result.exit_code == 2, result.output
    assert f"cannot listen on 127.0.0.1:{port}" in result.output
    assert "Traceback" not in result.output
