"""The roofline of a profile: what each kernel moves and computes, what the machine can do,
and how close each group of operations comes.

  * `hlo_costs`: bytes and FLOPs of every instruction of XLA's optimised HLO (a compiled
    program's `as_text()`). Bytes are what a kernel reads and writes: its operands and its
    result, except that an in-place update (a fusion ending in dynamic-update-slice or
    scatter, whose result aliases its largest operand) moves only its update, read and
    written. FLOPs are 2 x M x N x K of every dot, in a fusion or a cuBLAS custom call.
  * `group_of`: which op group an operation belongs to, from the named scopes the models
    put in its `op_name` (`qkv`, `attention`, `o_proj`, `mlp`, `norm`, `embed`, `lm_head`,
    `draft`, `proposal`, `accept`, `sample`).
  * `measure_peaks`: the copy bandwidth and matmul rate of the device, measured in the
    same process (a roofline against datasheet numbers flatters nobody).
  * `group_table`: per group, time, bytes and FLOPs per pass, the achieved bandwidth and
    FLOP rate with their share of the measured peaks, and the group's floor (the larger of
    bytes / bandwidth and FLOPs / matmul rate) with how far above it the group runs.

A library kernel (cuBLAS's `nvjet_*`) is named after itself in a GPU trace; inside a CUDA
graph (XLA's command buffers) its event names the command buffer, not its custom call, so
`resolve_kernel_names` places it by the schedule: between the fusions launched before and
after it, the program's library calls in order (`hlo_schedule`). Any other kernel whose
name the HLO does not hold (a Pallas kernel on a GPU) gets its group from its name and
no bytes; `profile_step` gives the target's attention the bytes it must read
(the KV cache of the context) instead of the page pools its kernels take as operands.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import statistics
import time

from dspine_benchmarks.hlo_names import HEADER

# Precedence: the first scope found in an op_name wins (the drafter's layers hold their own
# `qkv` and `attention`, and its context update sits inside the step's `accept`).
GROUPS = ("draft", "proposal", "sample", "accept", "lm_head", "attention", "qkv", "o_proj",
          "mlp", "norm", "embed")
KERNEL_GROUPS = (("attention", "attention"), ("top_k", "proposal"), ("proposal", "proposal"),
                 ("nvjet", "gemm"), ("gemm", "gemm"), ("cutlass", "gemm"))
# Kernels a library launches for a custom call (cuBLAS, cuBLASLt, cuDNN).
LIBRARY_KERNEL = re.compile(r"nvjet|cutlass|cublas|gemm|xmma|cudnn", re.IGNORECASE)
LIBRARY_CALL = re.compile(r'custom_call_target="__(?:cublas|cudnn)')

ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
            "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*)$")
OPERAND = re.compile(r"%([\w.\-]+)")
GEMM_CALL = re.compile(r'custom_call_target="__cublas\$(?:lt\$matmul|gemm)')
CONTAINERS = ("while", "conditional", "call")


@dataclasses.dataclass
class Instruction:
    name: str
    computation: str
    shape: str                # the result type, as printed
    opcode: str
    operands: list[str]
    attributes: str

    @property
    def bytes(self) -> int:
        return type_bytes(self.shape)


@dataclasses.dataclass(frozen=True)
class Cost:
    bytes: float = 0.0
    flops: float = 0.0
    container: bool = False     # a loop or call: its body's kernels are events of their own


def itemsize(dtype: str) -> float:
    if dtype.startswith("f8") or dtype.startswith("s4") or dtype.startswith("u4"):
        return 1 if dtype.startswith("f8") else 0.5
    return ITEMSIZE.get(dtype, 0)


def type_bytes(text: str) -> int:
    """Bytes of an HLO type (`bf16[8,128]{1,0}`, or a tuple of them)."""
    return int(sum(math.prod(int(d) for d in dims.split(",") if d) * itemsize(dtype)
                   for dtype, dims in ARRAY.findall(text)))


def dims_of(text: str) -> list[int]:
    match = ARRAY.search(text)
    return [int(d) for d in match.group(2).split(",") if d] if match else []


def _split_type(rest: str) -> tuple[str, str]:
    """'TYPE opcode(...), attrs' -> (TYPE, 'opcode(...), attrs'); a tuple type has parens."""
    if not rest.startswith("("):
        head, _, tail = rest.partition(" ")
        return head, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:i + 1], rest[i + 1:].lstrip()
    return rest, ""


def _split_call(text: str) -> tuple[str, str, str]:
    """'opcode(operands), attrs' -> (opcode, operands, attrs)."""
    opcode, _, rest = text.partition("(")
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return opcode.strip(), rest[:i], rest[i + 1:]
    return opcode.strip(), rest, ""


def parse_hlo(text: str) -> dict[str, Instruction]:
    """Every instruction of an HLO module's text, by name (names are unique per module)."""
    instructions, computation = {}, ""
    for line in text.splitlines():
        header = HEADER.match(line)
        if header:
            computation = header.group(1)
            continue
        match = INSTRUCTION.match(line)
        if not match:
            continue
        name, rest = match.groups()
        shape, call = _split_type(rest)
        opcode, operands, attributes = _split_call(call)
        instructions[name] = Instruction(name, computation, shape, opcode,
                                         OPERAND.findall(operands), attributes)
    return instructions


DOT_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
# a cuBLAS gemm custom call keeps its dimension numbers in its backend config
GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([\d",]*)\]')


def _matmul_flops(inst: Instruction, table: dict[str, Instruction],
                  contracting_dims: re.Pattern) -> float:
    """2 x the result's size (its first array) x the contracted size of the lhs operand."""
    contracting = contracting_dims.search(inst.attributes)
    lhs = table.get(inst.operands[0]) if inst.operands else None
    if contracting is None or lhs is None:
        return 0.0
    lhs_dims = dims_of(lhs.shape)
    k = math.prod(lhs_dims[int(i)] for i in contracting.group(1).replace('"', "").split(",")
                  if i)
    return 2.0 * math.prod(dims_of(inst.shape)) * k


def hlo_costs(text: str) -> dict[str, Cost]:
    """{instruction name, and its GPU-kernel spelling ('.' as '_'): Cost} of one module."""
    table = parse_hlo(text)
    by_computation = collections.defaultdict(list)
    for inst in table.values():
        by_computation[inst.computation].append(inst)

    def called(inst: Instruction) -> list[Instruction]:
        match = re.search(r"calls=%([\w.\-]+)", inst.attributes)
        return by_computation.get(match.group(1), []) if match else []

    def flops(inst: Instruction) -> float:
        if inst.opcode == "dot":
            return _matmul_flops(inst, table, DOT_CONTRACTING)
        if inst.opcode == "custom-call" and GEMM_CALL.search(inst.attributes):
            return _matmul_flops(inst, table, GEMM_CONTRACTING)
        if inst.opcode == "fusion":
            return sum(flops(i) for i in called(inst))
        return 0.0

    costs = {}
    for inst in table.values():
        if inst.opcode in CONTAINERS:
            costs[inst.name] = costs[inst.name.replace(".", "_")] = Cost(container=True)
            continue
        if inst.opcode in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast"):
            continue
        operand_bytes = [table[o].bytes for o in inst.operands if o in table]
        moved = inst.bytes + sum(operand_bytes)
        body = called(inst) if inst.opcode == "fusion" else [inst]
        in_place = any(i.opcode in ("dynamic-update-slice", "scatter") for i in body)
        if in_place and operand_bytes and max(operand_bytes) >= inst.bytes > 0:
            # the result aliases its largest operand: only the rest is read, and written
            rest = sum(operand_bytes) - max(operand_bytes)
            moved = 2 * rest
        cost = Cost(bytes=float(moved), flops=flops(inst))
        costs[inst.name] = costs[inst.name.replace(".", "_")] = cost
    return costs


def group_of(op_name: str, kernel: str = "") -> str:
    """The op group of an operation: the first of `GROUPS` among its op_name's scopes, else
    a guess from its kernel name, else 'other'."""
    scopes = set(op_name.split("/"))
    for group in GROUPS:
        if group in scopes:
            return group
    for key, group in KERNEL_GROUPS:
        if key in kernel.lower():
            return group
    return "other"


# ----- what the device can do ----------------------------------------------------------------
def _median_seconds(fn, *args, repeats: int = 10) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_peaks(dtype=None) -> dict:
    """{'copy_gb_s', 'matmul_tflop_s', and what was run}: x + 1 over a large array (read and
    written once) and one square matmul, each the median of 10 runs. Sizes: 1 GiB and 8192
    on an accelerator, 64 MiB and 1024 on a CPU."""
    import jax
    import jax.numpy as jnp

    accelerator = jax.default_backend() != "cpu"
    dtype = dtype or (jnp.bfloat16 if accelerator else jnp.float32)
    n = (1 << 30 if accelerator else 64 << 20) // jnp.dtype(dtype).itemsize
    x = jnp.ones((n,), dtype)
    copy = _median_seconds(jax.jit(lambda a: a + 1), x)
    del x
    m = 8192 if accelerator else 1024
    a = jnp.ones((m, m), dtype)
    matmul = _median_seconds(jax.jit(lambda p, q: p @ q), a, a)
    return {"copy_gb_s": 2 * n * jnp.dtype(dtype).itemsize / copy / 1e9,
            "matmul_tflop_s": 2 * m ** 3 / matmul / 1e12,
            "copy_bytes": 2 * n * jnp.dtype(dtype).itemsize, "matmul_size": m,
            "dtype": jnp.dtype(dtype).name}


# ----- the table -----------------------------------------------------------------------------
@dataclasses.dataclass
class Schedule:
    """Where each instruction runs in its computation's sequence (a scheduled module prints
    its instructions in the order they run), and each computation's library calls."""
    position: dict[str, tuple[str, int]]            # name (both spellings) -> (comp, index)
    library_calls: dict[str, list[tuple[int, str]]]  # comp -> [(index, custom call)]


def hlo_schedule(texts) -> Schedule:
    position, calls = {}, collections.defaultdict(list)
    for text in texts:
        index = collections.Counter()
        for inst in parse_hlo(text).values():
            i = index[inst.computation]
            index[inst.computation] += 1
            position[inst.name] = position[inst.name.replace(".", "_")] = (inst.computation, i)
            if inst.opcode == "custom-call" and LIBRARY_CALL.search(inst.attributes):
                calls[inst.computation].append((i, inst.name))
    return Schedule(position, dict(calls))


def resolve_kernel_names(events: list[dict], known, schedule: Schedule | None = None,
                         passes: int = 1) -> list[dict]:
    """Events named after the HLO instruction they ran: a library kernel (cuBLAS's
    `nvjet_*`, cuDNN's) is named after itself in a GPU trace, and its HLO instruction (the
    custom call whose op_name and costs are known) is in the event's `hlo_op` argument,
    unless it ran in a CUDA graph, whose events name the command buffer. `hlo_op` also
    names the instruction a shared kernel ran for (XLA compiles identical fusions to one
    kernel, named after the first of them). Library kernels in a graph are placed by
    `schedule`: on each stream, a run of library kernels between two anchors takes
    the library calls scheduled between those two, one kernel each in order (or all of
    them the one call, where only one lies between). An anchor is a kernel the schedule
    holds that ran once a pass (`passes` in the trace): XLA names a kernel shared by
    identical fusions (every layer's norm, say) after the first of them, so a kernel
    that ran more often does not say where in the schedule it ran. Events already named
    after a `known` instruction stay as they are; the rest keep their names."""
    out = []
    for e in events:
        hlo_op = e.get("args", {}).get("hlo_op")
        # hlo_op before the name: XLA compiles identical fusions (the target's and the
        # drafter's layers at one width, say) to one kernel named after the first
        if hlo_op in known and hlo_op.replace(".", "_") != e["name"].replace(".", "_"):
            e = {**e, "name": hlo_op, "kernel": e["name"]}
        out.append(e)
    if schedule is not None:
        _place_library_kernels(out, schedule, passes)
    return out


def _place_library_kernels(events: list[dict], schedule: Schedule, passes: int) -> None:
    runs = collections.Counter(e["name"] for e in events)
    streams = collections.defaultdict(list)
    for i, e in enumerate(events):
        streams[(e.get("pid"), e.get("tid"))].append(i)
    for indices in streams.values():
        indices.sort(key=lambda i: events[i].get("ts", 0.0))
        anchor, run = None, []          # the last scheduled kernel; library kernels since

        def place(after, before):
            if not run or after is None or before is None or after[0] != before[0]:
                return
            between = [name for i, name in schedule.library_calls.get(after[0], ())
                       if after[1] < i < before[1]]
            if len(between) == len(run):
                names = between
            elif len(between) == 1:
                names = between * len(run)
            else:
                return
            for i, name in zip(run, names):
                events[i] = {**events[i], "name": name, "kernel": events[i]["name"]}

        for i in indices:
            name = events[i]["name"]
            if name in schedule.position:
                # a shared kernel ends the run without placing it
                here = schedule.position[name] if runs[name] == passes else None
                place(anchor, here)
                anchor, run = here, []
            elif LIBRARY_KERNEL.search(name):
                run.append(i)


def group_rows(events: list[dict], passes: int, op_names: dict[str, str],
               costs: dict[str, Cost], peaks: dict,
               bytes_override: dict[str, float] | None = None) -> list[dict]:
    """Per group: us, bytes and FLOPs per pass, achieved rates and shares, floor.
    events: device events (name, dur in us); bytes_override: {group: bytes per pass}."""
    us, moved, flops = (collections.Counter() for _ in range(3))
    for e in events:
        cost = costs.get(e["name"], Cost())
        if cost.container:      # a CPU trace's loop event spans its body's events
            continue
        group = group_of(op_names.get(e["name"], ""), e["name"])
        us[group] += e["dur"]
        moved[group] += cost.bytes
        flops[group] += cost.flops
    total = sum(us.values()) or 1e-9
    rows = []
    for group, t in us.most_common():
        t_pass = t / passes
        b = (bytes_override or {}).get(group, moved[group] / passes)
        f = flops[group] / passes
        seconds = t_pass * 1e-6
        floor = max(b / (peaks["copy_gb_s"] * 1e9), f / (peaks["matmul_tflop_s"] * 1e12))
        rows.append({
            "group": group, "us_per_pass": t_pass, "share": t / total,
            "bytes_per_pass": b, "flops_per_pass": f,
            "gb_s": b / seconds / 1e9 if seconds else 0.0,
            "bandwidth_share": b / seconds / 1e9 / peaks["copy_gb_s"] if seconds else 0.0,
            "tflop_s": f / seconds / 1e12 if seconds else 0.0,
            "matmul_share": f / seconds / 1e12 / peaks["matmul_tflop_s"] if seconds else 0.0,
            "floor_us": floor * 1e6, "x_floor": seconds / floor if floor else None})
    return rows


def group_table(rows: list[dict]) -> str:
    lines = [f"{'group':<10} {'us/pass':>9} {'share':>6} {'MB/pass':>9} {'GFLOP':>8} "
             f"{'GB/s':>8} {'% bw':>6} {'TFLOP/s':>8} {'% mm':>6} {'floor us':>9} {'x floor':>8}"]
    for r in rows:
        x = f"{r['x_floor']:8.1f}" if r["x_floor"] else f"{'':>8}"
        lines.append(
            f"{r['group']:<10} {r['us_per_pass']:9.1f} {r['share']:6.1%} "
            f"{r['bytes_per_pass'] / 1e6:9.3f} {r['flops_per_pass'] / 1e9:8.3f} "
            f"{r['gb_s']:8.1f} {r['bandwidth_share']:6.1%} {r['tflop_s']:8.2f} "
            f"{r['matmul_share']:6.1%} {r['floor_us']:9.1f} {x}")
    return "\n".join(lines)
