"""The SGLang plugin against the real sglang package: DSPINE registers through
SpeculativeAlgorithm.register and answers SGLang's scheduler as DFLASH does; the draft
model class registers where SGLang's DFlash model imports (it needs SGLang's CUDA-side
dependencies). The DSpine math the plugin runs is dspine_torch.kernels, covered by
tests/test_torch_kernels.py and the parity tests."""

from __future__ import annotations

import pytest


def _import_sglang_registry():
    try:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from sglang.srt.speculative.spec_registry import CustomSpecAlgo
    except Exception as e:  # sglang absent, or installed without its dependencies
        pytest.skip(f"sglang's speculative registry does not import here ({type(e).__name__}: "
                    f"{e}); install sglang with its dependencies to test the plugin")
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
