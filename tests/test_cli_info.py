"""`dspine --version` and `dspine info`'s list of the built-in drafters."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from typer.testing import CliRunner

from dspine_cli.main import app
from dspine_jax.registry import BUILTIN_DRAFTERS

ROOT = Path(__file__).parents[1]


def test_version_is_the_package_version():
    result = CliRunner().invoke(app, ["--version"])
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert result.exit_code == 0 and result.output == f"dspine-jax {version}\n"


def test_info_lists_the_builtin_drafters(tiny_llama_dir):
    result = CliRunner().invoke(app, ["info", "--target", str(tiny_llama_dir)])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["num_hidden_layers"] == 2          # the target's own configuration
    drafters = {d["name"]: d for d in info["built_in_drafters"]}
    assert drafters.keys() == BUILTIN_DRAFTERS.keys()
    for name, d in drafters.items():
        config = json.loads((Path(d["folder"]) / "config.json").read_text())
        kind = "dspine" if "dspine_config" in config else "dflash"
        assert (d["target"], d["kind"]) == ("smollm2-135m-instruct", kind)
        assert name == f"{d['target']}-{d['kind']}"
        assert (d["layers"], d["block_size"]) == (config["num_hidden_layers"],
                                                  config["block_size"])
