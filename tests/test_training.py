"""Training pipeline: regenerated data, config errors, sharded steps, exact resume,
corrupted checkpoints."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from typer.testing import CliRunner

from dspine_cli.main import app
from dspine_jax.data.prompts import is_held_out
from dspine_jax.data.shards import load_dataset, read_manifest
from dspine_jax.errors import ConfigError, InputError
from dspine_jax.runtime.offline import generate_tokens
from tests.conftest import save_hf_model, write_tiny_tokenizer
from dspine_train.config import load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny Qwen3 target with a tokenizer, a prompts file and its regenerated data."""
    root = tmp_path_factory.mktemp("train")
    model = root / "model"
    model.mkdir()
    save_hf_model(model, "qwen3", tie_word_embeddings=True, vocab_size=320, num_hidden_layers=4)
    write_tiny_tokenizer(model, vocab_size=300)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(24):
            f.write(json.dumps({"prompt": f"the quick brown fox {i}", "chat": i % 2 == 0}) + "\n")
    result = CliRunner().invoke(app, [
        "data", "regenerate", "--target", str(model), "--source", str(root / "prompts.jsonl"),
        "--out", str(root / "data"), "--max-new-tokens", "20", "--batch-size", "5",
        "--shard-size", "8"])
    assert result.exit_code == 0, result.output
    return root


def config_text(root: Path, out: Path, steps=4, **sections) -> str:
    base = {
        "target": {"name": str(root / "model")},
        "drafter": {"kind": "dspine", "layers": 2, "block_size": 4, "mask_token_id": 5},
        "data": {"path": str(root / "data"), "seq_len": 48, "blocks_per_seq": 4},
        "run": {"out": str(out), "steps": steps, "batch_size": 8, "compute_dtype": "f32",
                "log_every": 2, "checkpoint_every": 2},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    lines = []
    for name, values in base.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def run_cli(*args):
    return CliRunner().invoke(app, list(args))


def drafter_tensors(out: Path) -> dict:
    return load_file(out / "drafter" / "model.safetensors")


def test_regenerated_data_are_the_targets_greedy_responses(workspace):
    from dspine_jax.api import Pipeline, Prompt

    manifest = read_manifest(workspace / "data")
    assert [s["prompts"] for s in manifest["shards"]] == [8, 8, 8]
    sequences = load_dataset(workspace / "data")
    pipe = Pipeline.load(str(workspace / "model"))
    # Batches of 5 in shards of 8: rows 5-7 were decoded in a batch padded to 5 rows.
    for i in (0, 5, 6, 7):
        ids = pipe.encode(Prompt(f"the quick brown fox {i}", i % 2 == 0))
        want = generate_tokens(pipe.decoder, [ids], max_new_tokens=20).generations[0].tokens
        assert sequences[i].tokens.tolist() == ids + want, i
        mask = sequences[i].loss_mask
        assert not mask[:len(ids)].any() and mask[len(ids):].all()


def test_regeneration_resumes_and_refuses_other_settings(workspace, tmp_path, monkeypatch):
    import dspine_train.regenerate as regen

    out = tmp_path / "data"
    real = regen.write_shard
    calls = []

    def crash_after_first(*args):
        if calls:
            raise KeyboardInterrupt  # the job dies while working on its second shard
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(regen, "write_shard", crash_after_first)
    kw = dict(target=str(workspace / "model"), source=str(workspace / "prompts.jsonl"),
              max_new_tokens=20, batch_size=8, shard_size=8)
    with pytest.raises(KeyboardInterrupt):
        regen.regenerate(out, **kw)
    first = (out / "shard-00000.npz").stat().st_mtime_ns
    assert len(read_manifest(out)["shards"]) == 1
    monkeypatch.setattr(regen, "write_shard", real)
    regen.regenerate(out, **kw)
    assert (out / "shard-00000.npz").stat().st_mtime_ns == first   # not redone
    resumed = load_dataset(out)
    straight = load_dataset(workspace / "data")
    assert [s.tokens.tolist() for s in resumed] == [s.tokens.tolist() for s in straight]
    with pytest.raises(InputError, match="other settings \\(max_new_tokens\\)"):
        regen.regenerate(out, **{**kw, "max_new_tokens": 10})


def test_sharegpt_held_out_split_is_fixed_and_disjoint():
    ids = [f"conv{i}" for i in range(2000)]
    held = [i for i in ids if is_held_out(i)]
    assert 60 < len(held) < 140                       # ~5%
    assert held == [i for i in ids if is_held_out(i)]  # stable


@pytest.mark.slow
def test_sharegpt_prompts_split():
    from dspine_jax.data.prompts import sharegpt_prompts

    train_ids = {p["id"] for p in sharegpt_prompts("train")}
    held = {p["id"] for p in sharegpt_prompts("heldout")}
    assert len(train_ids) > 13000 and 500 < len(held) < 1200 and not train_ids & held
    # no conversation is on both sides (ShareGPT splits long ones into ID_0, ID_1, ...)
    conversation = lambda i: i.rsplit("_", 1)[0]  # noqa: E731
    assert not {conversation(i) for i in train_ids} & {conversation(i) for i in held}


def test_config_errors_are_named(tmp_path):
    with pytest.raises(ConfigError, match="unknown field run.stepz"):
        load_config(None, ["run.stepz=3"])
    with pytest.raises(ConfigError, match="run.batch_size must be int, got str"):
        load_config(None, ['run.batch_size="eight"'])
    with pytest.raises(ConfigError, match="optim.lr must be float, got bool"):
        load_config(None, ["optim.lr=true"])
    with pytest.raises(ConfigError, match="unknown config section \\[optimizer\\]"):
        load_config(None, ["optimizer.lr=1.0"])
    (tmp_path / "bad.toml").write_text("[run\nsteps = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "bad.toml")
    result = run_cli("train", "--set", "drafter.layerz=2")
    assert result.exit_code == 2 and "unknown field drafter.layerz" in result.output


def test_training_learns_and_exports(workspace, tmp_path):
    out = tmp_path / "run"
    (tmp_path / "c.toml").write_text(config_text(workspace, out, steps=8,
                                                 optim={"lr": 3e-3, "warmup_ratio": 0.0}))
    result = run_cli("train", "--config", str(tmp_path / "c.toml"))
    assert result.exit_code == 0, result.output
    rows = (out / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    losses = [float(r.split(",")[header.index("loss")]) for r in rows[1:]]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert (out / "metrics.png").stat().st_size > 10_000
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["DSpineDraftModel"] and cfg["num_hidden_layers"] == 2
    # The exported drafter decodes losslessly with the engine.
    gen = run_cli("generate", "--target", str(workspace / "model"), "-p", "the quick",
                  "--method", "dspine", "--drafter", str(out / "drafter"), "-n", "6", "--json",
                  "--ignore-eos")
    ar = run_cli("generate", "--target", str(workspace / "model"), "-p", "the quick", "-n",
                 "6", "--json", "--ignore-eos")
    assert json.loads(gen.stdout)["tokens"] == json.loads(ar.stdout)["tokens"]
    # --json says what ran: the exported DSpine under adaptive speculation, and plain AR
    spec, plain = json.loads(gen.stdout)["runtime"], json.loads(ar.stdout)["runtime"]
    assert (spec["method"], spec["proposal"], spec["speculation"]["speculation"]) == (
        "dspine", "sparse", "adaptive")
    assert spec["speculation"]["widths"][0] == 0 and spec["switches"] == plain["switches"]
    assert (plain["method"], plain["proposal"], plain["speculation"]) == ("ar", None, None)
    # and the engine it ran on: one slot, a context sized for the prompt and 6 tokens
    engine = json.loads(gen.stdout)["engine"]
    assert engine["max_slots"] == 1 and 6 < engine["max_model_len"] <= 64


@pytest.mark.parametrize("kind", ["dflash", "dspine"])
def test_kill_and_resume_matches_an_uninterrupted_run(workspace, tmp_path, kind):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for out in (straight, resumed):
        (out.parent / f"{out.name}.toml").write_text(
            config_text(workspace, out, steps=6, drafter={"kind": kind}))
    assert run_cli("train", "--config", str(tmp_path / "straight.toml")).exit_code == 0
    stopped = run_cli("train", "--config", str(tmp_path / "resumed.toml"), "--set",
                      "run.stop_after=3")
    assert stopped.exit_code == 0 and "stopped at step 3" in stopped.output
    assert not (resumed / "drafter").exists()
    again = run_cli("train", "--config", str(tmp_path / "resumed.toml"))
    assert again.exit_code == 0 and "finished at step 6" in again.output
    a, b = drafter_tensors(straight), drafter_tensors(resumed)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    changed = run_cli("train", "--config", str(tmp_path / "resumed.toml"), "--set",
                      "optim.lr=0.1", "--set", "run.steps=8")
    assert changed.exit_code == 2 and "another configuration" in changed.output


def test_corrupted_checkpoint_is_reported_not_restarted(workspace, tmp_path):
    out = tmp_path / "run"
    (tmp_path / "c.toml").write_text(config_text(workspace, out, steps=4))
    assert run_cli("train", "--config", str(tmp_path / "c.toml"), "--set",
                   "run.stop_after=2").exit_code == 0
    step_dir = out / "checkpoints" / "2"
    victims = [p for p in step_dir.rglob("*") if p.is_file() and p.stat().st_size > 0
               and "state" in str(p)]
    assert victims
    for path in victims:
        path.write_bytes(b"\x00garbage" * 3)
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    result = run_cli("train", "--config", str(tmp_path / "c.toml"))
    assert result.exit_code == 2
    assert "checkpoint 2" in result.output and "unreadable" in result.output
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


SHARDED = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=" + sys.argv[1]
    from dspine_train.config import load_config
    from dspine_train.trainer import train
    cfg = load_config(sys.argv[2], sys.argv[3:])
    train(cfg, progress=False)
""")


def run_sharded(devices: int, config: Path, *overrides: str):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", SHARDED, str(devices), str(config),
                             *overrides], capture_output=True, text=True, env=env, cwd=ROOT,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]


def test_eight_fake_devices_match_one_device(workspace, tmp_path):
    outs = {"one": tmp_path / "one", "data8": tmp_path / "data8", "fsdp": tmp_path / "fsdp"}
    meshes = {"one": (1, ["mesh.data=1"]), "data8": (8, ["mesh.data=8"]),
              "fsdp": (8, ["mesh.data=4", "mesh.fsdp=2"])}
    for name, out in outs.items():
        (tmp_path / f"{name}.toml").write_text(config_text(workspace, out, steps=2))
        devices, overrides = meshes[name]
        run_sharded(devices, tmp_path / f"{name}.toml", *overrides)
    one = drafter_tensors(outs["one"])
    # Same math, different reduction order: Adam's m/sqrt(v) magnifies the float noise of
    # near-zero gradients, so compare at a fraction of the step size (lr 6e-4), not ulps.
    for name in ("data8", "fsdp"):
        other = drafter_tensors(outs[name])
        for key in one:
            # DSpine's whitening map is not trained: it comes from float32 covariance sums
            # whose order follows the device count, and 1/sqrt(eigenvalue) amplifies that.
            tol = dict(rtol=5e-3, atol=1e-4) if key.startswith("transfer_") else \
                dict(rtol=2e-4, atol=1e-5)
            np.testing.assert_allclose(other[key], one[key], err_msg=key, **tol)
    shutil.rmtree(tmp_path)


def test_cached_features_train_like_online_ones(workspace, tmp_path):
    online, cached = tmp_path / "online", tmp_path / "cached"
    (tmp_path / "online.toml").write_text(config_text(workspace, online, steps=2))
    (tmp_path / "cached.toml").write_text(config_text(workspace, cached, steps=2,
                                                      data={"cached_features": True}))
    missing = run_cli("train", "--config", str(tmp_path / "cached.toml"))
    assert missing.exit_code == 2 and "run `dspine data features`" in missing.output
    assert run_cli("data", "features", "--config", str(tmp_path / "cached.toml")).exit_code == 0
    assert run_cli("train", "--config", str(tmp_path / "cached.toml")).exit_code == 0
    assert run_cli("train", "--config", str(tmp_path / "online.toml")).exit_code == 0
    a, b = drafter_tensors(online), drafter_tensors(cached)
    for name in a:  # float16 storage of the features is the only difference
        np.testing.assert_allclose(b[name], a[name], atol=2e-4, err_msg=name)



@pytest.mark.parametrize("kind", ["dflash", "dspine"])
def test_fused_loss_trains_like_the_dense_one(workspace, tmp_path, kind):
    """`dspine train` with loss.logits = fused (lm_head_stats, no [B, n, K, V] logits) and
    dense, the shipped CE recipe: the same logged losses and nearly the same drafter; and
    a chain link may switch between them."""
    runs = {}
    for logits in ("dense", "fused"):
        out = tmp_path / logits
        (tmp_path / f"{logits}.toml").write_text(config_text(
            workspace, out, steps=4, drafter={"kind": kind},
            loss={"backbone": "ce", "alignment": False, "logits": logits,
                  "candidates": "logits" if logits == "dense" else "kernel"}))
        result = run_cli("train", "--config", str(tmp_path / f"{logits}.toml"))
        assert result.exit_code == 0, result.output
        rows = (out / "metrics.csv").read_text().splitlines()
        header = rows[0].split(",")
        runs[logits] = [[float(r.split(",")[header.index(c)]) for r in rows[1:]]
                        for c in ("loss", "coverage")]
    np.testing.assert_allclose(runs["fused"], runs["dense"], rtol=1e-4)
    a, b = drafter_tensors(tmp_path / "dense"), drafter_tensors(tmp_path / "fused")
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-3, atol=1e-5, err_msg=name)
    from dspine_train.trainer import _chain_key
    configs = [json.loads((tmp_path / name / "config.json").read_text())
               for name in ("dense", "fused")]
    for c in configs:      # what differs besides the vocabulary path: where they write
        c["run"].pop("out")
        c["loss"].pop("candidates")
    assert _chain_key(configs[0]) == _chain_key(configs[1])

def test_sigterm_or_deadline_checkpoints_and_stops(workspace, tmp_path):
    import os
    import signal

    from dspine_train.stopping import StopRequest

    before = signal.getsignal(signal.SIGTERM)
    request = StopRequest(0)
    assert not request.now(10, 5)
    os.kill(os.getpid(), signal.SIGTERM)          # a preempted host, or `timeout`
    assert request.now(10, 5) and not request.now(11, 5)  # only at agreed steps
    request.release()
    assert signal.getsignal(signal.SIGTERM) == before

    out = tmp_path / "run"
    (tmp_path / "d.toml").write_text(config_text(workspace, out, steps=4))
    stopped = run_cli("train", "--config", str(tmp_path / "d.toml"), "--set",
                      "run.max_seconds=1e-6", "--set", "run.log_every=1")
    assert stopped.exit_code == 0 and "stopped at step 1" in stopped.output
    assert (out / "checkpoints" / "1").is_dir() and not (out / "drafter").exists()
    again = run_cli("train", "--config", str(tmp_path / "d.toml"), "--set", "run.log_every=1")
    assert again.exit_code == 0 and "finished at step 4" in again.output


MESH_CHECK = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import numpy as np
    from dspine_train import mesh_check, sharding
    if sys.argv[1] == "broken":  # a mesh that feeds its devices the wrong rows
        place = sharding.global_batch
        mesh_check.sharding.global_batch = lambda rows, mesh: place(
            rows[::-1] if mesh.devices.size > 1 else rows, mesh)
    sys.exit(mesh_check.main(["--config", sys.argv[2], "--set", "mesh.fsdp=2"]))
""")


@pytest.mark.parametrize("mode", ["sound", "broken"])
def test_mesh_check_passes_a_sound_mesh_and_names_a_broken_one(workspace, tmp_path, mode):
    (tmp_path / "c.toml").write_text(config_text(workspace, tmp_path / "run", steps=2))
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", MESH_CHECK, mode, str(tmp_path / "c.toml")],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    if mode == "sound":
        assert result.returncode == 0, result.stdout + result.stderr[-2000:]
        assert "the mesh matches one device" in result.stdout
    else:
        assert result.returncode == 1, result.stdout + result.stderr[-2000:]
        assert "MISMATCH" in result.stdout and "FAIL features" in result.stdout


def test_relative_gap_never_passes_a_nan():
    from dspine_train.mesh_check import real_positions, relative_gap

    assert relative_gap([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert relative_gap([1.0, 2.0], [1.0, 2.2]) == pytest.approx(0.2 / np.sqrt(5))
    assert relative_gap([1.0, 2.0], [1.0, float("nan")]) == float("inf")
    mask = np.array([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 1]], bool)
    np.testing.assert_array_equal(real_positions(mask), [[1, 1, 1, 0, 0], [0, 0, 0, 0, 0],
                                                          [1, 1, 1, 1, 1]])


def test_the_training_step_compiles_once(workspace, tmp_path, caplog):
    """Step 2 must reuse step 1's program: an input whose placement changes after the first
    step (the rng key came back committed to the mesh) cost a second compilation, 15 s per
    run start on the H200."""
    import logging

    import jax

    from dspine_train.trainer import train

    (tmp_path / "c.toml").write_text(config_text(workspace, tmp_path / "run", steps=3))
    with caplog.at_level(logging.WARNING), jax.log_compiles():
        train(load_config(tmp_path / "c.toml", []), progress=False)
    compiles = [r for r in caplog.records if "Compiling jit(step)" in r.getMessage()]
    assert len(compiles) == 1, [r.getMessage()[:300] for r in compiles]


def test_two_processes_train_like_one_device(workspace, tmp_path):
    """Multi-host training as on a TPU pod (or one process per GPU): two processes with one
    CPU device each, parameters and optimizer state split across them (fsdp), the export
    gathered from both. Placing arrays with device_put failed here before: a sharding
    that spans another process's devices is not addressable."""
    one, multi = tmp_path / "one", tmp_path / "multi"
    (tmp_path / "one.toml").write_text(config_text(workspace, one, steps=3))
    (tmp_path / "multi.toml").write_text(config_text(workspace, multi, steps=3))
    assert run_cli("train", "--config", str(tmp_path / "one.toml")).exit_code == 0
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    from dspine_benchmarks.train_scaling import free_port

    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "dspine_cli", "train", "--distributed",
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
         "--config", str(tmp_path / "multi.toml"), "--set", "mesh.fsdp=2"],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "drafter exported" in outputs[0] and "drafter exported" not in outputs[1]
    reference, got = drafter_tensors(one), drafter_tensors(multi)
    assert reference.keys() == got.keys()
    for key in reference:
        tol = dict(rtol=5e-3, atol=1e-4) if key.startswith("transfer_") else \
            dict(rtol=2e-4, atol=1e-5)
        np.testing.assert_allclose(got[key], reference[key], err_msg=key, **tol)


def launch_pod(config: Path, cache: Path, *overrides: str, processes=4, devices_each=2):
    """`dspine train --distributed` in `processes` CPU processes of `devices_each` fake
    devices, as on the hosts of a TPU pod slice (jax.distributed over localhost). The
    launches of one test share a compilation cache: a relaunch compiles nothing new."""
    from dspine_benchmarks.train_scaling import free_port

    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_each}",
               JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    port = free_port()
    sets = [arg for kv in overrides for arg in ("--set", kv)]
    return [subprocess.Popen(
        [sys.executable, "-m", "dspine_cli", "train", "--distributed", "--coordinator",
         f"127.0.0.1:{port}", "--num-processes", str(processes), "--process-id", str(i),
         "--config", str(config), *sets],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(processes)]


def finish(procs) -> list[str]:
    outputs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), \
        "\n".join(out + err[-3000:] for out, err in outputs)
    return [out for out, _ in outputs]


def preempt_after_first_step(procs, steps: int) -> list[str]:
    """SIGTERM to host 0 (a preempted TPU VM) once its progress bar shows a step done
    (its handler is installed by then); every host's output after they stop."""
    import signal
    import threading

    seen, first_step = [], threading.Event()

    def watch():                                   # host 0's progress bar, on stderr
        while chunk := procs[0].stderr.read(64):
            seen.append(chunk)
            if re.search(rf"\b[1-9]\d*/{steps}\b", "".join(seen[-3:])):
                first_step.set()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert first_step.wait(600), "".join(seen)[-3000:]
    procs[0].send_signal(signal.SIGTERM)
    outputs = [procs[0].stdout.read()] + [p.communicate(timeout=600)[0] for p in procs[1:]]
    procs[0].wait(timeout=600)
    watcher.join(timeout=10)
    assert [p.returncode for p in procs] == [0] * len(procs), "".join(seen)[-3000:]
    return outputs


def test_pod_rehearsal_four_hosts_preempted_resume_bit_exact(workspace, tmp_path):
    """A TPU pod slice rehearsed on the CPU: four hosts (processes) of two devices each
    train on a 2 x 4 data x fsdp mesh, parameters and optimizer state split across hosts.
    Host 0 is preempted (SIGTERM) after a step: every host agrees on one step,
    checkpoints it and exits; the job is relaunched, resumes and finishes. Its drafter
    equals, bit for bit, that of the same four hosts trained without a stop. (A single
    process with the same eight devices matches to float rounding only: the gradient sum
    over hosts adds in another order; test_two_processes_train_like_one_device.)"""
    steps, mesh = 6, ["mesh.data=2", "mesh.fsdp=4"]   # checks at 2 and 4 stop early
    cache = tmp_path / "compilation-cache"
    runs = {name: tmp_path / name for name in ("straight", "preempted")}
    for name, out in runs.items():
        (tmp_path / f"{name}.toml").write_text(config_text(
            workspace, out, steps=steps, drafter={"kind": "dflash"},
            run={"log_every": 2, "checkpoint_every": 100}))   # hosts agree every 2 steps
    finish(launch_pod(tmp_path / "straight.toml", cache, *mesh))

    outputs = preempt_after_first_step(launch_pod(tmp_path / "preempted.toml", cache, *mesh),
                                       steps)
    stopped = [re.search(r"stopped at step (\d+)", out) for out in outputs]
    assert all(stopped) and len({m.group(1) for m in stopped}) == 1, outputs
    at = int(stopped[0].group(1))
    assert 1 <= at < steps and (runs["preempted"] / "checkpoints" / str(at)).is_dir()
    assert not (runs["preempted"] / "drafter").exists()

    resumed = finish(launch_pod(tmp_path / "preempted.toml", cache, *mesh))
    assert all(f"finished at step {steps}" in out for out in resumed), resumed
    reference, got = drafter_tensors(runs["straight"]), drafter_tensors(runs["preempted"])
    assert reference.keys() == got.keys()
    for key in reference:
        np.testing.assert_array_equal(got[key], reference[key], err_msg=key)


def launch_script(*args, **env):
    """train/launch_tpu_pod.sh under bash with an empty PATH: no gcloud, no git (REPO_URL
    and REV given), nothing else the dry run may call."""
    import shutil

    return subprocess.run([shutil.which("bash"), str(ROOT / "train" / "launch_tpu_pod.sh"),
                           *args], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={"PATH": str(ROOT / "tests" / "fixtures" / "no-such-bin"),
                               "HOME": "/nonexistent", **env})


def bash_words(line: str) -> list[str]:
    """The arguments bash reads from a printed command line."""
    import shutil

    out = subprocess.run([shutil.which("bash"), "-c", 'eval "set -- $1"; printf "%s\\0" "$@"',
                          "_", line], capture_output=True, text=True, check=True).stdout
    return out.split("\0")[:-1]


def test_launch_tpu_pod_dry_run_prints_every_command(tmp_path):
    import shlex

    config = "train/configs/qwen3_8b_dspine.toml"
    result = launch_script("--dry-run", "my-pod", "us-east5-a", config, "--set",
                           "run.steps=20", "--set", 'run.out="/mnt/shared/q 8b"',
                           REPO_URL="https://example.com/dspine-jax.git", REV="abc123")
    assert result.returncode == 0, result.stderr
    copy, launch, *script = result.stdout.splitlines()
    assert bash_words(copy) == ["gcloud", "compute", "tpus", "tpu-vm", "scp", config,
                                 "my-pod:~/train.toml", "--zone", "us-east5-a", "--worker=all"]
    words = bash_words(launch)
    assert words[:9] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-pod", "--zone",
                         "us-east5-a", "--worker=all"] and words[9] == "--command"
    remote = words[10]
    assert script == ["# every worker of my-pod runs:", *remote.splitlines()]
    assert "git clone https://example.com/dspine-jax.git dspine-jax" in remote
    assert "git checkout -q abc123" in remote
    # the worker's shell hands `dspine train` each --set pair whole, quotes and space kept
    train = shlex.split(remote.splitlines()[-1])
    assert train == ["dspine", "train", "--distributed", "--config", "~/train.toml", "--set",
                     "run.steps=20", "--set", 'run.out="/mnt/shared/q 8b"']
    assert subprocess.run(["bash", "-n", "-c", remote]).returncode == 0
    plain = launch_script("--dry-run", "my-pod", "z", config, REPO_URL="u", REV="r")
    assert plain.stdout.splitlines()[-1] == "dspine train --distributed --config ~/train.toml"

    missing = launch_script("my-pod", "z", config, REPO_URL="u", REV="r")
    assert missing.returncode == 2 and "gcloud is not on PATH" in missing.stderr
    bad = launch_script("--dry-run", "my-pod", "z", str(tmp_path / "none.toml"),
                        REPO_URL="u", REV="r")
    assert bad.returncode == 2 and "no such config file" in bad.stderr


def test_process_options_need_distributed(tmp_path):
    result = run_cli("train", "--config", str(tmp_path / "none.toml"), "--num-processes", "2")
    assert result.exit_code == 2 and "need --distributed" in result.output


def gpu_count() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return listing.stdout.count("GPU ") if listing.returncode == 0 else 0


@pytest.mark.gpu
@pytest.mark.parametrize("mesh", [["mesh.data=2"], ["mesh.data=1", "mesh.fsdp=2"]])
def test_two_gpus_compute_what_one_gpu_computes(workspace, tmp_path, mesh):
    """The single-process two-GPU mesh, value by value against one GPU (on two H200s under
    JAX 0.11.2 it trained to NaN: docs/benchmarks.md, multi-GPU training)."""
    if gpu_count() < 2:
        pytest.skip("needs two GPUs")
    (tmp_path / "c.toml").write_text(config_text(workspace, tmp_path / "run", steps=2))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("JAX_PLATFORMS", None)
    sets = [arg for kv in mesh for arg in ("--set", kv)]
    result = subprocess.run([sys.executable, "-m", "train.mesh_check", "--config",
                             str(tmp_path / "c.toml"), *sets], capture_output=True, text=True,
                            env=env, cwd=ROOT, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_the_drafter_trains_in_the_compute_dtype(workspace, tmp_path, monkeypatch):
    """With run.compute_dtype bf16, every matmul of the step runs in bf16 except the
    transfer-space codes, which are float32 by design (operand [D, r]). A drafter whose
    activations stayed float32 ran all of them in float32: 8% MFU on the H200."""
    import re

    import jax

    from dspine_train import trainer

    lowered, real_jit = {}, jax.jit

    def capture(fn, **kwargs):
        compiled = real_jit(fn, **kwargs)

        def first_call(*args):
            lowered["text"] = compiled.lower(*args).as_text()
            raise KeyboardInterrupt  # enough: the program is what this test reads
        return first_call

    monkeypatch.setattr(trainer.jax, "jit", capture)
    (tmp_path / "c.toml").write_text(config_text(
        workspace, tmp_path / "run", steps=2, target={"dtype": "bf16"},
        run={"compute_dtype": "bf16"}))
    with pytest.raises(KeyboardInterrupt):
        trainer.train(load_config(tmp_path / "c.toml", []), progress=False)
    dots = re.findall(r"stablehlo\.dot_general .*?: \(tensor<([\dx]+)x(\w+)>, "
                      r"tensor<([\dx]+)x(\w+)>\)", lowered["text"])
    assert len(dots) > 50
    config = json.loads((workspace / "model" / "config.json").read_text())
    hidden = config["hidden_size"]
    float32 = [d for d in dots if "f32" in (d[1], d[3])]
    transfer = [d for d in float32 if re.fullmatch(rf"{hidden}x\d+", d[2])]
    assert float32 == transfer, float32[:5]
    assert sum(d[1] == d[3] == "bf16" for d in dots) > 0.8 * len(dots)


def test_cudnn_target_attention_computes_the_reference_attention():
    """CudnnBackend's call (layout, GQA, causal mask, scale) through jax.nn's XLA path
    equals the reference attention on right-padded causal inputs; a paged or non-causal
    call goes the XLA way."""
    import jax
    import jax.numpy as jnp

    from dspine_jax.attention.backend import CudnnBackend, XlaBackend
    from dspine_jax.attention.metadata import AttentionMetadata

    b, t, n, kv, h = 2, 12, 6, 2, 16
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, t, n, h))
    k = jax.random.normal(keys[1], (b, t, kv, h))
    v = jax.random.normal(keys[2], (b, t, kv, h))
    causal = AttentionMetadata.causal(jnp.broadcast_to(jnp.arange(t), (b, t)))
    want, _ = XlaBackend()(q, k, v, causal)
    got, pages = CudnnBackend(implementation="xla")(q, k, v, causal)
    assert pages is None
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    paged = AttentionMetadata.paged(jnp.asarray([3, 5]), jnp.arange(2)[:, None], t)
    pages = tuple(jnp.zeros((2, 32, kv, h)) for _ in range(2))
    got, got_pages = CudnnBackend(implementation="xla")(q, k, v, paged, pages)
    want, want_pages = XlaBackend()(q, k, v, paged, pages)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_pages[0], want_pages[0])


@pytest.mark.parametrize("kind", ["dflash", "dspine"])
def test_cudnn_drafter_attention_computes_the_training_blocks_attention(kind):
    """The drafter's packed training blocks (each sees the context before its anchor and
    its own block) through CudnnBackend's masked call (jax.nn's XLA path here) equal the
    reference attention: the mask goes in as [B, 1, T, S] over every head."""
    import jax
    import jax.numpy as jnp

    from dspine_jax.attention.backend import CudnnBackend, XlaBackend
    from dspine_jax.attention.metadata import AttentionMetadata
    from dspine_jax.drafters.blocks import training_mask

    b, t, n, blocks, size, kv, h = 2, 20, 6, 3, 4, 2, 16
    anchors = jnp.asarray([[2, 7, 12], [0, 9, 15]])
    ctx_visible = jnp.arange(t)[None, None, :] < anchors[..., None]
    mask = training_mask(ctx_visible, size, kind == "dspine")  # [B, n*K, T + n*K]
    assert mask.shape == (b, blocks * size, t + blocks * size)
    assert not mask.all(-1).any() and mask.any(-1).all()    # partial rows, none empty
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (b, blocks * size, n, h))
    k = jax.random.normal(keys[1], (b, t + blocks * size, kv, h))
    v = jax.random.normal(keys[2], (b, t + blocks * size, kv, h))
    positions = (anchors[..., None] + jnp.arange(size)).reshape(b, -1)
    metadata = AttentionMetadata.dense(positions, mask, "block_diagonal")
    got, pages = CudnnBackend(implementation="xla")(q, k, v, metadata)
    assert pages is None
    np.testing.assert_allclose(got, XlaBackend()(q, k, v, metadata)[0], rtol=1e-5,
                               atol=1e-5)


def test_target_attention_option_is_checked_before_the_target_loads(tmp_path):
    from dspine_train.trainer import train

    with pytest.raises(ConfigError, match=r"target.attention must be one of \('auto', 'xla', "
                                          r"'cudnn'\), got 'flash'"):
        load_config_text(tmp_path, {"attention": "flash"})
    cfg = load_config_text(tmp_path, {"attention": "cudnn", "dtype": "bf16",
                                      "name": str(tmp_path / "no-such-target")})
    with pytest.raises(ConfigError, match="does not run on the cpu platform"):
        train(cfg, progress=False)


def test_drafter_attention_option_is_checked_before_the_target_loads(tmp_path):
    from dspine_train.trainer import train

    (tmp_path / "c.toml").write_text(config_text(tmp_path, tmp_path / "run",
                                                 drafter={"attention": "flash"}))
    with pytest.raises(ConfigError, match=r"drafter.attention must be one of \('auto', "
                                          r"'xla', 'cudnn'\), got 'flash'"):
        load_config(tmp_path / "c.toml", [])
    (tmp_path / "c.toml").write_text(config_text(
        tmp_path, tmp_path / "run", target={"name": str(tmp_path / "no-such-target")},
        drafter={"attention": "cudnn"}, run={"compute_dtype": "bf16"}))
    with pytest.raises(ConfigError, match="drafter.attention = 'cudnn' does not run on the "
                                          "cpu platform"):
        train(load_config(tmp_path / "c.toml", []), progress=False)


def test_auto_attention_is_cudnn_only_where_it_runs(tmp_path):
    """"auto" (the default, target and drafter) picks cuDNN on a CUDA GPU in bf16 and XLA
    otherwise (the CPU, or float32 anywhere), without an error."""
    import jax
    import jax.numpy as jnp

    from dspine_jax.attention.backend import CudnnBackend, XlaBackend
    from dspine_train.trainer import training_attention

    cfg = load_config_text(tmp_path, {})
    assert cfg.target.attention == cfg.drafter.attention == "auto"
    on_gpu = jax.default_backend() == "gpu"
    bf16 = training_attention("auto", jnp.bfloat16, "drafter.attention")
    assert isinstance(bf16, CudnnBackend) == on_gpu and isinstance(bf16, XlaBackend)
    assert type(training_attention("auto", jnp.float32, "target.attention")) is XlaBackend
    assert type(training_attention("xla", jnp.bfloat16, "target.attention")) is XlaBackend


def load_config_text(tmp_path, target: dict):
    (tmp_path / "c.toml").write_text(config_text(tmp_path, tmp_path / "run", target=target))
    return load_config(tmp_path / "c.toml", [])


def test_training_runs_the_target_through_its_attention_option(workspace, tmp_path,
                                                              monkeypatch):
    """The step's target and drafter forwards use target.attention's and
    drafter.attention's backends: through jax.nn's XLA path the cudnn calls (the target's
    causal mask, the drafter's blocks as a bias) train like the reference attention."""
    from dspine_jax.attention.backend import CudnnBackend
    from dspine_train import trainer

    curves = {}
    for name in ("xla", "cudnn-as-xla"):
        if name != "xla":
            calls = {}

            def counting(choice, dtype, key):
                class Counting(CudnnBackend):
                    def __call__(self, q, k, v, metadata, pages=None):
                        calls.setdefault(key, set()).add(metadata.mask)
                        return super().__call__(q, k, v, metadata, pages)
                return Counting(implementation="xla")
            monkeypatch.setattr(trainer, "training_attention", counting)
        out = tmp_path / name
        (tmp_path / f"{name}.toml").write_text(config_text(workspace, out, steps=4))
        trainer.train(load_config(tmp_path / f"{name}.toml", []), progress=False)
        with open(out / "metrics.csv") as f:
            curves[name] = [float(line.split(",")[1]) for line in list(f)[1:]]
    # each model's layers called its backend while tracing the step
    assert calls == {"target.attention": {"causal"}, "drafter.attention": {"block_diagonal"}}
    np.testing.assert_allclose(curves["cudnn-as-xla"], curves["xla"], rtol=1e-4)


@pytest.mark.gpu
def test_cudnn_target_attention_on_a_gpu():
    import jax
    import jax.numpy as jnp

    from dspine_jax.attention.backend import CudnnBackend, XlaBackend
    from dspine_jax.attention.metadata import AttentionMetadata

    if jax.default_backend() != "gpu":
        pytest.skip(f"needs a CUDA GPU; JAX backend here is {jax.default_backend()!r}")
    b, t, n, kv, h = 4, 512, 9, 3, 64
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (b, t, heads, h), jnp.bfloat16)
               for key, heads in zip(keys, (n, kv, kv)))
    causal = AttentionMetadata.causal(jnp.broadcast_to(jnp.arange(t), (b, t)))
    want = XlaBackend()(q.astype(jnp.float32), k.astype(jnp.float32),
                        v.astype(jnp.float32), causal)[0]
    got = CudnnBackend()(q, k, v, causal)[0]
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_cudnn_drafter_attention_on_a_gpu():
    """cuDNN's masked call over SmolLM2-sized training blocks, and its gradients, against
    the float32 reference attention."""
    import jax
    import jax.numpy as jnp

    from dspine_jax.attention.backend import CudnnBackend, XlaBackend
    from dspine_jax.attention.metadata import AttentionMetadata
    from dspine_jax.drafters.blocks import training_mask

    if jax.default_backend() != "gpu":
        pytest.skip(f"needs a CUDA GPU; JAX backend here is {jax.default_backend()!r}")
    b, t, blocks, size, n, kv, h = 2, 256, 8, 16, 9, 3, 64
    anchors = jnp.sort(jax.random.randint(jax.random.key(3), (b, blocks), 0, t - size), -1)
    mask = training_mask(jnp.arange(t)[None, None, :] < anchors[..., None], size, True)
    positions = (anchors[..., None] + jnp.arange(size)).reshape(b, -1)
    metadata = AttentionMetadata.dense(positions, mask, "block_diagonal")
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (b, length, heads, h), jnp.bfloat16)
               for key, length, heads in zip(keys, (blocks * size, t + blocks * size,
                                                    t + blocks * size), (n, kv, kv)))

    def loss(backend, q, k, v):
        return jnp.sum(backend(q, k, v, metadata)[0].astype(jnp.float32) ** 2)

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = XlaBackend()(*f32, metadata)[0]
    got = jax.jit(lambda q, k, v: CudnnBackend()(q, k, v, metadata)[0])(q, k, v)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2, rtol=2e-2)
    want_grads = jax.grad(lambda *x: loss(XlaBackend(), *x), argnums=(0, 1, 2))(*f32)
    got_grads = jax.jit(jax.grad(lambda *x: loss(CudnnBackend(), *x), argnums=(0, 1, 2)))(
        q, k, v)
    for g, w in zip(got_grads, want_grads):
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(np.asarray(g, np.float32) / scale, w / scale, atol=3e-2)
