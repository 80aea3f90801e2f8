"""The house rules the layout promises: every package installs, no import cycles, and
dependencies point one way (front ends -> dspine_jax -> pallas_kernels)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
FOLDERS = {name: ROOT / SETUPTOOLS["package-dir"].get(name, name)
           for name in ("dspine_jax", "pallas_kernels", "dspine_cli", "dspine_train",
                        "dspine_serve", "dspine_benchmarks", "dspine_torch")}


def modules() -> dict[str, Path]:
    """Import name -> file, for every module of every installed top-level package."""
    found = {}
    for top, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((top,) + parts)] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports, at any depth of the file (function-level
    imports close cycles too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def test_every_package_folder_is_installed():
    listed = set(SETUPTOOLS["packages"])
    on_disk = {name.rpartition(".")[0] if path.name != "__init__.py" else name
               for name, path in modules().items()}
    on_disk = {n for n in on_disk if (FOLDERS[n.split(".")[0]].joinpath(
        *n.split(".")[1:]) / "__init__.py").is_file()}
    assert on_disk <= listed, f"packages missing from pyproject.toml: {on_disk - listed}"


def test_no_import_cycles():
    found = modules()
    graph = {name: imports_of(name, path, set(found)) for name, path in found.items()}
    # A package's __init__ importing its own modules is how packages re-export; a module
    # importing its package's __init__ is then the only "cycle" Python resolves fine.
    graph = {n: {m for m in deps if not n.startswith(m + ".")} for n, deps in graph.items()}
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_dependencies_point_one_way():
    found = modules()
    front_ends = ("dspine_cli", "dspine_train", "dspine_serve", "dspine_benchmarks")
    for name, path in found.items():
        deps = imports_of(name, path, set(found))
        if name.startswith("pallas_kernels"):
            assert not [d for d in deps if not d.startswith("pallas_kernels")], name
        elif name.startswith("dspine_torch"):
            # The PyTorch port stands alone: the JAX install must not need torch, and the
            # port is checked against JAX only through golden files and the parity command.
            assert not [d for d in deps if not d.startswith("dspine_torch")], name
        elif name.startswith("dspine_jax"):
            # The library serves the front ends and never reaches back into them
            assert not [d for d in deps if d.startswith(front_ends)], name
