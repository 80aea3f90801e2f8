"""Which JAX operation each kernel of a profile runs: XLA's optimised HLO, dumped as text,
names every fusion and custom call, and its metadata holds the operation it came from
(`op_name`: the jit, its transforms, then the primitive or the einsum spec). A GPU
trace names a kernel after its HLO instruction with '.' written '_'
(`%gemm_fusion_dot.877` runs as `gemm_fusion_dot_877`); a CPU trace uses the name as is.

The dump must be asked for before JAX compiles anything (XLA reads its flags once).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%([\w.\-]+) = .*?metadata=\{op_name="([^"]*)"')
BARE = re.compile(r'^\s*(?:ROOT\s+)?%([\w.\-]+) = .*?calls=%([\w.\-]+)')
HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")


def dump_hlo_to(folder: Path, module: str) -> None:
    """XLA writes every module whose name holds `module` that it compiles from now on
    into `folder`, as text."""
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = (f"{flags} --xla_dump_to={folder} --xla_dump_hlo_as_text "
                               f"--xla_dump_hlo_module_re=.*{module}.*").strip()


def dumped_modules(folder: Path, module: str) -> set[str]:
    """File names of the optimised HLO of every dumped module whose name holds `module`."""
    return {p.name for p in Path(folder).glob(f"*{module}*after_optimizations.txt")}


def op_names(text: str) -> dict[str, str]:
    """{instruction name, and its kernel spelling: op_name} of one module's HLO text. A
    fusion whose own line has no metadata (XLA's CPU fusions often drop it) takes the
    op_name of the first instruction of its fused computation that has one."""
    names, first_in = {}, {}
    computation, unnamed = "", []
    for line in text.splitlines():
        header = HEADER.match(line)
        if header:
            computation = header.group(1)
            continue
        match = INSTRUCTION.match(line)
        if match:
            name, op = match.groups()
            names.setdefault(name, op)
            first_in.setdefault(computation, op)
            continue
        bare = BARE.match(line)
        if bare:
            unnamed.append(bare.groups())
    for name, called in unnamed:
        if called in first_in:
            names.setdefault(name, first_in[called])
    return {**names, **{n.replace(".", "_"): op for n, op in names.items()}}


def module_op_names(folder: Path, files: set[str]) -> dict[str, str]:
    names = {}
    for name in sorted(files):
        for key, op in op_names((Path(folder) / name).read_text()).items():
            names.setdefault(key, op)
    return names
