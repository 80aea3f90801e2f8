"""The SGLang plugin against the real sglang package: DSPINE registers through
SpeculativeAlgorithm.register and answers SGLang's scheduler as DFLASH does; the draft
model class registers where SGLang's DFlash model imports (it needs SGLang's CUDA-side
dependencies). The DSpine math the plugin runs is dspine_torch.kernels, covered by
tests/test_torch_kernels.py and the parity tests."""

from __future__ import annotations

import pytest


def _import_sglang_registry():
    """SGLang's registry, or a skip where sglang is not installed. Installed (the test
    command installs it without its dependencies, the `test` extra what the registry
    imports), it must import: a failure is an error, not a skip."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed: install it as the README's test command does "
                    "to test the plugin")
    try:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from sglang.srt.speculative.spec_registry import CustomSpecAlgo
    except ModuleNotFoundError as e:
        pytest.fail(f"sglang's speculative registry needs {e.name!r}, which the test extra "
                    "does not install")
    return SpeculativeAlgorithm, CustomSpecAlgo


def test_dspine_registers_as_a_dflash_family_algorithm():
    SpeculativeAlgorithm, CustomSpecAlgo = _import_sglang_registry()
    from dspine_torch import sglang_plugin

    sglang_plugin.register_algorithm()
    sglang_plugin.register_algorithm()                      # idempotent
    algo = SpeculativeAlgorithm.from_string("dspine")
    assert isinstance(algo, CustomSpecAlgo) and algo.name == "DSPINE"
    assert algo.is_dflash() and algo.is_dflash_family() and algo.is_speculative()
    assert not algo.is_none() and not algo.is_eagle()
    dflash = SpeculativeAlgorithm.DFLASH
    predicates = [n for n in vars(SpeculativeAlgorithm) if n.startswith(("is_", "supports_"))]
    assert predicates
    for name in predicates:
        assert getattr(algo, name)() == getattr(dflash, name)(), name
    assert algo.factory is sglang_plugin.worker_factory
    assert algo.supports_overlap


def test_the_registry_refuses_a_second_registration_under_the_name():
    SpeculativeAlgorithm, _ = _import_sglang_registry()
    from dspine_torch import sglang_plugin

    sglang_plugin.register_algorithm()
    with pytest.raises(ValueError, match="already registered"):
        SpeculativeAlgorithm.register("DSPINE")(lambda server_args: None)


def test_the_entry_point_is_declared():
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    points = pyproject["project"]["entry-points"]["sglang.srt.plugins"]
    assert points == {"dspine": "dspine_torch.sglang_plugin:register"}


def test_the_draft_model_registers_where_sglang_dflash_imports():
    _import_sglang_registry()
    try:
        import sglang.srt.models.dflash  # noqa: F401
        from sglang.srt.models.registry import ModelRegistry
    except Exception as e:
        pytest.skip(f"sglang's DFlash model does not import here ({type(e).__name__}: {e})")
    from dspine_torch import sglang_plugin

    sglang_plugin.register_model()
    cls = ModelRegistry.models["DSpineDraftModel"]
    assert cls.__name__ == "DSpineDraftModel"
    assert issubclass(cls, sglang.srt.models.dflash.DFlashDraftModel)


# ----- the walk at T > 0: each row's full warp, as the kernels' reference ----------------------
def _lattice(seed: int, b: int = 6, s: int = 5, c: int = 8, vocab: int = 50):
    import torch

    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(b, s, c, c, generator=g) * 2
    scores[:, 0] = scores[:, 0, :1]                  # slot 0 scores from the anchor only
    candidates = torch.stack([torch.randperm(vocab, generator=g)[:c] for _ in range(b * s)])
    return scores, candidates.reshape(b, s, c), torch.rand(b, s, generator=g)


def test_the_walk_warps_q_as_the_kernels_reference():
    """Per row (its own temperature, top_p, top_k; greedy rows), the plugin's walk draws
    the tokens and q of `dspine_proposal.reference.chain_walk` at the same uniforms."""
    import torch

    from dspine_torch.kernels.dspine_proposal import reference
    from dspine_torch.sglang_plugin import selector_walk

    scores, candidates, u = _lattice(0)
    params = [(0.7, 0.9, 0), (1.0, 1.0, 3), (1.3, 0.5, 5), (0.9, 1.0, 0), (1.0, 1.0, 1 << 30),
              (1.0, 1.0, 1)]                           # the last: SGLang's greedy (top_k 1)
    temps = torch.tensor([t for t, _, _ in params])
    top_ps = torch.tensor([p for _, p, _ in params])
    top_ks = torch.tensor([k for _, _, k in params])
    greedy = top_ks <= 1
    tokens, q = selector_walk(candidates, scores, u, temps, greedy, top_ps, top_ks)
    for i, (t, p, k) in enumerate(params):
        want = reference.chain_walk(scores[i:i + 1], candidates[i:i + 1], 0.0 if greedy[i]
                                    else t, p, min(k, 8), u[i:i + 1])
        assert torch.equal(tokens[i], want[0][0]), i
        torch.testing.assert_close(q[i], want[1][0], atol=1e-6, rtol=0)
    # top-k and top-p zero out q where the target's warp zeroes p
    assert int((q[1] > 0).sum(-1).max()) <= 3 and int((q[2] > 0).sum(-1).max()) <= 5
    assert bool((q[5].sum(-1) == 1).all()) and int((q[5] > 0).sum()) == q.shape[1]


def test_the_walk_would_differ_with_temperature_only():
    """The check above can fail: a temperature-only walk (SGLang's own) puts q mass
    outside the top-k / top-p set."""
    import torch

    from dspine_torch.sglang_plugin import selector_walk

    scores, candidates, u = _lattice(1, b=2)
    temps, greedy = torch.ones(2), torch.zeros(2, dtype=torch.bool)
    warped = selector_walk(candidates, scores, u, temps, greedy, torch.tensor([1.0, 0.5]),
                           torch.tensor([2, 0]))
    plain = selector_walk(candidates, scores, u, temps, greedy, torch.ones(2),
                          torch.zeros(2, dtype=torch.long))
    assert not torch.allclose(warped[1], plain[1])
    assert int((warped[1][0] > 0).sum(-1).max()) <= 2 < int((plain[1][0] > 0).sum(-1).min())


def test_the_worker_stages_top_p_and_top_k_where_sglang_stages_temperatures():
    """The worker glue, against stand-ins for SGLang's DFlash worker and graph sampler
    (the real ones need SGLang's CUDA-side dependencies)."""
    import types

    import torch

    from dspine_torch.sglang_plugin import RowWarp, worker_class

    class Selector:
        def __init__(self):
            self.warp = RowWarp()

        def reserve(self, rows, device):
            self.warp.reserve(rows, device)

        def stage_warp(self, bs, sampling_info):
            self.warp.stage(bs, sampling_info, "cpu")

    class GraphSampler:
        temperatures = torch.ones(8)
        staged = None

        def stage_sampling_params(self, *, bs, sampling_info):
            self.staged = bs

    class Base:
        def __init__(self):
            self.selector = Selector()

        def _propose_selector_block(self, *, bs, sampling_info, **kwargs):
            return self.selector.warp.rows(bs, "cpu")

        def _maybe_build_draft_sampler(self):
            return GraphSampler()

    worker = worker_class(Base)()
    info = types.SimpleNamespace(top_ps=torch.tensor([0.5, 0.9, 1.0]),
                                 top_ks=torch.tensor([4, 1 << 30, 2], dtype=torch.int32))
    top_ps, top_ks = worker._propose_selector_block(bs=3, sampling_info=info,
                                                    draft_logits_output=None)
    assert top_ps.tolist() == [0.5, 0.8999999761581421, 1.0] and top_ks.tolist() == [4, 1 << 30, 2]
    sampler = worker._maybe_build_draft_sampler()
    buffer = worker.selector.warp.top_ps
    assert buffer.shape[0] == 8                          # reserved for the largest graph
    sampler.stage_sampling_params(bs=2, sampling_info=info)
    assert sampler.staged == 2 and worker.selector.warp.top_ps is buffer   # same address
    assert buffer[:2].tolist() == [0.5, 0.8999999761581421]
    sampler.stage_sampling_params(bs=2, sampling_info=None)
    assert buffer[:2].tolist() == [1.0, 1.0] and worker.selector.warp.top_ks[:2].tolist() == [0, 0]


# ----- the export against SGLang's own DFlash config parser ------------------------------------
PARSER = "parse_dflash_draft_config"


def _sglang_dflash_parser():
    """SGLang's `parse_dflash_draft_config` (sglang/srt/speculative/dflash_utils.py), run
    from SGLang's own source. That module imports SGLang's CUDA-side kernels at the top,
    so where it does not import, its file is loaded narrowly: the parser and the
    top-level definitions it reaches (plain Python and standard-library imports only),
    executed as written. Nothing of the parser is re-implemented here."""
    import ast
    import importlib.util
    import sys

    try:
        from sglang.srt.speculative import dflash_utils
        return getattr(dflash_utils, PARSER)
    except ImportError:
        pass
    except Exception as e:
        pytest.skip(f"sglang's dflash_utils fails to import ({type(e).__name__}: {e})")
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed: the export's config cannot be checked against "
                    "SGLang's DFlash config parser")
    from pathlib import Path

    path = Path(next(iter(spec.submodule_search_locations))) / "srt/speculative/dflash_utils.py"
    if not path.is_file():
        pytest.skip(f"this sglang has no {path.name}: its DFlash config parser moved")
    tree = ast.parse(path.read_text())
    defined = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    defined[t.id] = node
    if PARSER not in defined:
        pytest.skip(f"{path} has no {PARSER}: SGLang's DFlash config parser moved")
    needed, todo = set(), [PARSER]
    while todo:
        name = todo.pop()
        if name in needed or name not in defined:
            continue
        needed.add(name)
        todo += [n.id for n in ast.walk(defined[name]) if isinstance(n, ast.Name)]
    keep = [node for node in tree.body if node in {defined[n] for n in needed}]
    stdlib = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
              and all((a.name if isinstance(node, ast.Import) else node.module or "")
                      .split(".")[0] in sys.stdlib_module_names | {"__future__"}
                      for a in node.names)]
    import types

    module = types.ModuleType("sglang_dflash_config_parser")   # dataclasses look it up
    module.__file__ = str(path)
    sys.modules[module.__name__] = module
    try:
        exec(compile(ast.Module(body=stdlib + keep, type_ignores=[]), str(path), "exec"),  # noqa: S102 SGLang's own parser
             module.__dict__)
    except Exception as e:
        pytest.skip(f"SGLang's DFlash config parser does not load without its CUDA-side "
                    f"imports ({type(e).__name__}: {e})")
    finally:
        sys.modules.pop(module.__name__, None)
    namespace = module.__dict__
    return namespace[PARSER]


@pytest.mark.parametrize("kind", ["dflash", "dspine"])
def test_sglang_reads_the_exported_config_as_our_drafter(tmp_path, kind):
    """`dspine export --format dflash-hf` writes a config.json from which SGLang's DFLASH
    algorithm (and the DSPINE plugin, which reuses it) reads the drafter we built: layer
    count, block size, the target layers whose outputs it reads, the mask token."""
    import json

    parse = _sglang_dflash_parser()
    from typer.testing import CliRunner

    from dspine_cli.main import app
    from dspine_torch import load_drafter
    from tests.torch_port_golden import FIXTURES, TARGET

    out = tmp_path / "export"
    result = CliRunner().invoke(app, ["export", "--drafter", str(FIXTURES / kind), "--out",
                                      str(out), "--target", str(FIXTURES / "target"),
                                      "--dtype", "f32"])
    assert result.exit_code == 0, result.output
    raw = json.loads((out / "config.json").read_text())
    ours = load_drafter(out).config
    theirs = parse(draft_hf_config=raw)
    assert theirs.num_hidden_layers == ours.num_hidden_layers
    assert theirs.num_target_layers == TARGET["num_hidden_layers"]
    assert theirs.resolve_block_size() == ours.block_size
    assert theirs.target_layer_ids == list(ours.target_layer_ids)
    # SGLang checks the ids against the target and uses them as given (no default spread).
    assert theirs.resolve_target_layer_ids(
        target_num_layers=TARGET["num_hidden_layers"],
        draft_num_layers=ours.num_hidden_layers) == list(ours.target_layer_ids)
    # The mask is an id of the target's vocabulary, so SGLang adds no mask token.
    assert theirs.mask_token_id == ours.mask_token_id
    assert not theirs.is_domino
