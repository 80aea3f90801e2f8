"""The README's promises about the `dspine` command and the Python API hold.

The command synopsis names only flags the CLI has; every command is in the synopsis; the
README's Python snippets run as printed; help shows switches as switches and never cuts
a default at 80 columns."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspine_cli.main import app

README = Path(__file__).resolve().parent.parent / "README.md"


def fenced_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.S | re.M)


def synopsis() -> list[str]:
    """Each `dspine ...` line of the README's bash blocks, its indented continuation lines
    joined on (they list more flags of the same command)."""
    commands = []
    for block in fenced_blocks("bash"):
        continuing = False
        for line in block.splitlines():
            if line.startswith("dspine "):
                commands.append(line)
                continuing = True
            elif continuing and line.startswith(" ") and line.strip():
                commands[-1] += " " + line.strip()
            else:
                continuing = False
    return commands


def subcommand(line: str) -> list[str]:
    words = []
    for word in line.split()[1:]:
        if word.startswith(("-", "[")):
            break
        words.append(word)
    return words


def help_text(words: list[str], columns: int = 80) -> str:
    result = CliRunner().invoke(app, [*words, "--help"], env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    return result.output


SYNOPSIS = synopsis()


def test_synopsis_was_found():
    # guards the parametrized test below against passing vacuously on a parse slip
    assert len(SYNOPSIS) >= 8 and {"generate", "eval"} <= {subcommand(s)[0] for s in SYNOPSIS}


@pytest.mark.parametrize("line", SYNOPSIS, ids=lambda line: " ".join(subcommand(line)))
def test_synopsis_flags_exist(line):
    text = help_text(subcommand(line))
    flags = sorted(set(re.findall(r"--[a-z][a-z0-9-]*", line)))
    missing = [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]
    assert not missing, f"README synopsis names {missing}, which `dspine " \
                        f"{' '.join(subcommand(line))} --help` does not list"


def test_every_command_is_in_the_synopsis():
    import typer.main

    documented = {" ".join(subcommand(line)) for line in SYNOPSIS}
    group = typer.main.get_command(app)
    commands = set()
    for name, command in group.commands.items():
        subs = getattr(command, "commands", None)
        commands |= {f"{name} {sub}" for sub in subs} if subs else {name}
    assert commands - documented == set()


def test_switches_are_shown_as_switches():
    """Typer's rich help printed `--chat <bool>`, and `--chat true` then failed."""
    text = help_text(["generate"])
    assert "<bool>" not in text
    assert re.search(r"^  --chat +Apply the checkpoint's chat template\.$", text, re.M)
    assert re.search(r"^  --ignore-eos +Run to", text, re.M)
    result = CliRunner().invoke(app, ["generate", "--chat", "true", "--prompt", "hi"])
    assert result.exit_code == 2 and "unexpected extra argument" in result.output


@pytest.mark.parametrize("words,shown", [
    (["generate"], ["[default: smollm2-135m-instruct]", "[default: 128; x>=1]",
                    "the drafter's kind with --drafter, else ar"]),
    (["eval"], ["default: all of math500, aime24, aime25, humaneval, mtbench, sharegpt, cnmo.",
                "A folder that already holds results is refused: pick a new one or delete "
                "the old results."]),
    (["export"], ["[default: dflash-hf]", "--code-table / --no-code-table"]),
    ([], ["Generate text: AR, or speculative with a drafter.",
          "Acceptance length, tokens/s and speedup over AR."]),
])
def test_help_is_not_cut_at_80_columns(words, shown):
    text = help_text(words, columns=80)
    assert "\u2026" not in text  # rich's cut-off mark
    assert max(len(line) for line in text.splitlines()) <= 80
    flat = " ".join(text.split())  # wrapping may move words to the next line, never drop them
    for piece in shown:
        assert piece in flat


def test_installed_command_help_at_80_columns():
    # the console script pip installed beside this interpreter (a venv not on PATH), else
    # the one on PATH
    beside = Path(sys.executable).parent / "dspine"
    command = str(beside) if beside.exists() else "dspine"
    result = subprocess.run([command, "generate", "--help"], capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "80"}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "[default: smollm2-135m-instruct]" in result.stdout and "<bool>" not in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(fenced_blocks("python"))))
def test_readme_python_runs(index, capsys):
    """Each ```python block of the README, as printed, in a fresh namespace (about a
    minute on 2 CPU cores: the SmolLM2 load plus two compilations)."""
    code = fenced_blocks("python")[index]
    exec(compile(code, f"README.md python block {index + 1}", "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out.strip()  # the snippets print what they generate


SHARED = ["--target", "--method", "--drafter", "--temperature", "--batch-size",
          "--dtype", "--attention-backend", "--proposal", "--proposal-kernel"]


def test_shared_options_read_the_same_in_every_command():
    """generate, eval and serve take these options from one definition: same default,
    metavar and help wherever a command has the option (eval's --drafter is repeatable)."""
    import typer.main

    group = typer.main.get_command(app)

    def options(name):
        return {opt: (p.default, p.metavar, p.help) for p in group.commands[name].params
                for opt in p.opts if opt in SHARED}

    seen = {name: options(name) for name in ("generate", "eval", "serve")}
    assert set(seen["generate"]) == set(SHARED)
    assert {"--proposal", "--proposal-kernel", "--dtype"} <= set(seen["eval"]) & set(seen["serve"])
    for name in ("eval", "serve"):
        for opt, described in seen[name].items():
            if not (name == "eval" and opt == "--drafter"):
                assert described == seen["generate"][opt], (name, opt)


def test_seed_reads_the_same_with_each_command_default():
    """--seed has one definition: generate samples from fresh seeds by default (sampled rows
    then take adaptive widths), eval and data regenerate from 0 (reproducible figures and
    data); the help differs only in its default's sentence."""
    import typer.main

    group = typer.main.get_command(app)
    commands = {"generate": group.commands["generate"], "eval": group.commands["eval"],
                "regenerate": group.commands["data"].commands["regenerate"]}
    seeds = {name: next(p for p in c.params if "--seed" in p.opts)
             for name, c in commands.items()}
    assert {name: p.default for name, p in seeds.items()} == {
        "generate": None, "eval": 0, "regenerate": 0}
    assert len({(p.metavar, p.help.split("Default:")[0]) for p in seeds.values()}) == 1
    assert "fresh seed" in seeds["generate"].help and "Default: 0." in seeds["eval"].help


def test_regenerate_takes_the_shared_options_from_the_same_definitions():
    """`dspine data regenerate` reads --target and --dtype as generate does, and
    --num-pages as serve does (only the default's sentence differs)."""
    import typer.main

    group = typer.main.get_command(app)

    def params(command):
        return {opt: p for p in command.params for opt in p.opts}

    regen = params(group.commands["data"].commands["regenerate"])
    generate, serve = params(group.commands["generate"]), params(group.commands["serve"])
    for opt in ("--target", "--dtype"):
        assert ((regen[opt].default, regen[opt].metavar, regen[opt].help)
                == (generate[opt].default, generate[opt].metavar, generate[opt].help)), opt
    ours, theirs = regen["--num-pages"], serve["--num-pages"]
    assert (ours.default, ours.metavar) == (theirs.default, theirs.metavar)
    assert ours.help.split("Default:")[0] == theirs.help.split("Default:")[0]
