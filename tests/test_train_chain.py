"""A long training run as a chain of short ones: the next link resumes another run
folder's full state (equal to one uninterrupted run, also when it moves to two devices),
or starts from its weights alone with a fresh optimizer; the links' metrics join into one
curve."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dspine_jax.data.shards import Sequence, write_manifest, write_shard
from tests.conftest import save_hf_model, write_tiny_tokenizer
from tests.test_training import ROOT, SHARDED, config_text, drafter_tensors, run_cli


@pytest.fixture(scope="module", autouse=True)
def compiled_once(tmp_path_factory):
    """Every run here compiles the same step program: keep it in a compilation cache
    (test time; each run builds its own jit)."""
    import jax

    saved = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir",
                                             "jax_persistent_cache_min_compile_time_secs",
                                             "jax_persistent_cache_min_entry_size_bytes")}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("xla")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    yield
    for key, value in saved.items():
        jax.config.update(key, value)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """A tiny target, random token data, a straight 6-step run and a first link of 3."""
    root = tmp_path_factory.mktemp("chain")
    (root / "model").mkdir()
    save_hf_model(root / "model", "qwen3", tie_word_embeddings=True, vocab_size=320,
                  num_hidden_layers=4)
    write_tiny_tokenizer(root / "model", vocab_size=300)
    rng = np.random.default_rng(0)
    sequences = [Sequence(rng.integers(0, 300, n).astype(np.int32), np.arange(n) >= 10)
                 for n in rng.integers(24, 48, 24)]
    (root / "data").mkdir()
    name = write_shard(root / "data", 0, sequences, "uint16")
    write_manifest(root / "data", {"settings": {}, "shards": [{"file": name}]})
    for run in ("straight", "link1"):
        (root / f"{run}.toml").write_text(config_text(root, root / run, steps=6))
    assert run_cli("train", "--config", str(root / "straight.toml")).exit_code == 0
    first = run_cli("train", "--config", str(root / "link1.toml"), "--set", "run.stop_after=3")
    assert first.exit_code == 0 and "stopped at step 3" in first.output
    return root


def test_a_chain_of_two_runs_equals_one_run(chain, tmp_path):
    from dspine_train.chain import join, main

    link2 = tmp_path / "link2"
    result = run_cli("train", "--config", str(chain / "link1.toml"), "--resume-from",
                     str(chain / "link1"), "--set", f"run.out={json.dumps(str(link2))}")
    assert result.exit_code == 0 and "finished at step 6" in result.output, result.output
    a, b = drafter_tensors(chain / "straight"), drafter_tensors(link2)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
    assert json.loads((link2 / "chain.json").read_text()) == {
        "start": "resume", "source": str(chain / "link1"), "start_step": 3}

    rows, starts = join([chain / "link1", link2])
    # Logged: every 2 steps, at the stop, and never a link's first (compiling) step.
    assert [r["step"] for r in rows] == [2, 3, 6] and starts == [0, 3]
    with open(chain / "straight" / "metrics.csv") as f:
        header, *lines = [line.strip().split(",") for line in f]
    straight = {int(line[0]): float(line[header.index("loss")]) for line in lines}
    for row in rows:
        if row["step"] in straight:  # the same step of the same trajectory
            assert float(row["loss"]) == straight[row["step"]], row["step"]
    assert main([str(chain / "link1"), str(link2), "--out", str(tmp_path / "joined")]) == 0
    assert (tmp_path / "joined" / "chain.png").stat().st_size > 10_000

    refused = run_cli("train", "--config", str(chain / "link1.toml"), "--resume-from",
                      str(chain / "link1"), "--set", "optim.lr=0.1",
                      "--set", f"run.out={json.dumps(str(tmp_path / 'other'))}")
    assert refused.exit_code == 2 and "another configuration (optim.lr)" in refused.output
    wrong = run_cli("train", "--config", str(chain / "link1.toml"), "--resume-from",
                    str(chain / "link1"), "--set", "drafter.layers=3",
                    "--set", f"run.out={json.dumps(str(tmp_path / 'other2'))}")
    assert wrong.exit_code == 2 and "another architecture (" in wrong.output
    assert "num_hidden_layers" in wrong.output


def test_weights_only_init_loads_the_saved_weights_with_a_fresh_optimizer(chain, tmp_path):
    import orbax.checkpoint as ocp

    from dspine_train.chain import join
    from dspine_train.checkpoints import Checkpoints

    out = tmp_path / "weights"
    (tmp_path / "w.toml").write_text(config_text(chain, out, steps=2, optim={"lr": 0.0}))
    result = run_cli("train", "--config", str(tmp_path / "w.toml"), "--init-from",
                     str(chain / "straight"))
    assert result.exit_code == 0 and "finished at step 2" in result.output, result.output
    # Learning rate 0: its two steps change nothing, so the export is the loaded weights.
    saved, got = drafter_tensors(chain / "straight"), drafter_tensors(out)
    assert saved.keys() == got.keys()
    for name in saved:
        np.testing.assert_array_equal(got[name], saved[name], err_msg=name)
    # A fresh AdamW: its step count is this run's 2 (the source's state had counted 6),
    # and the step counter, data position and schedule start over.
    manager = Checkpoints(out / "checkpoints", 3).manager
    state = manager.restore(2, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state
    counts = [np.asarray(v).item() for k, v in state.items() if k.endswith(".count")]
    assert counts and set(counts) == {2}, sorted(state)
    assert json.loads((out / "chain.json").read_text()) == {
        "start": "weights", "source": str(chain / "straight"), "start_step": 0}
    rows, starts = join([chain / "straight", out])
    assert [r["step"] for r in rows] == [2, 4, 6, 8] and starts == [0, 6]


def test_a_chain_link_moves_to_two_devices(chain, tmp_path):
    """The second link runs data parallel over two (CPU) devices: --set mesh.data=2."""
    path = [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    link2 = tmp_path / "link2"
    result = subprocess.run(
        [sys.executable, "-c", SHARDED, "2", str(chain / "link1.toml"), "mesh.data=2",
         f"run.resume_from={json.dumps(str(chain / 'link1'))}",
         f"run.out={json.dumps(str(link2))}"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = drafter_tensors(chain / "straight"), drafter_tensors(link2)
    for key in one:  # same math, another reduction order (test_training's tolerances)
        tol = dict(rtol=5e-3, atol=1e-4) if key.startswith("transfer_") else \
            dict(rtol=2e-4, atol=1e-5)
        np.testing.assert_allclose(two[key], one[key], err_msg=key, **tol)


def test_init_from_takes_a_built_in_drafter_name_and_checks_it_before_the_target_loads(
        chain, tmp_path, monkeypatch):
    """--init-from NAME reads a built-in drafter (here the shipped SmolLM2 one, which does
    not fit this tiny target: the mismatch is named); a name that is neither built in nor
    a folder is refused before the target loads."""
    from dspine_train import trainer

    (tmp_path / "w.toml").write_text(config_text(chain, tmp_path / "out", steps=2))
    built_in = run_cli("train", "--config", str(tmp_path / "w.toml"), "--init-from",
                       "smollm2-135m-instruct-dflash")
    assert built_in.exit_code == 2, built_in.output
    assert "drafter hidden_size is 576, the target's is 64" in built_in.output

    def no_target(*_, **__):
        raise AssertionError("loaded the target before checking --init-from")

    monkeypatch.setattr(trainer, "load_target", no_target)
    missing = run_cli("train", "--config", str(tmp_path / "w.toml"), "--init-from",
                      "no-such-drafter")
    assert missing.exit_code == 2
    assert "'no-such-drafter' is neither a built-in name" in missing.output
