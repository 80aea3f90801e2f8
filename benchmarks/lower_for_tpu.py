"""Lower every program for TPU on any host: the serving programs, the training step and
each Pallas kernel, with no TPU present.

  python -m dspine_benchmarks.lower_for_tpu --target preset:smollm2-135m
  python -m dspine_benchmarks.lower_for_tpu --target preset:qwen3-8b
  python -m dspine_benchmarks.lower_for_tpu --target preset:qwen3-8b --layers 4 \\
      --only train --train-config train/configs/qwen3_8b_dspine.toml
  python -m dspine_benchmarks.lower_for_tpu --target preset:qwen3-8b --cost-table

`jax.export(jax.jit(fn), platforms=("tpu",))` lowers a program for TPU on a CPU: Pallas's
Mosaic TPU lowering runs then, so a block shape the TPU cannot tile (last two dims neither
multiples of (8, 128) nor the whole array), an op Mosaic does not support, a kernel limit
or a sharding that does not fit the mesh fails here as it would on the TPU. What it cannot
check: Mosaic's own compile to TPU code (VMEM limits, scheduling) and the numbers.

Programs, built from the decoders' step API (`create_caches`, `prefill`, `empty_state`,
`start`, `decode`) with random weights of the target's shapes held abstract
(`nnx.eval_shape`: nothing is allocated, Qwen3-8B included), in bf16 as on a TPU:
  serve/{ar,dflash,dspine}/{prefill,decode} T=0 and T>0   the pallas attention backend's
      TPU kernel and DSpine's TPU proposal kernel (`vocab_top_k`); prefill of a
      --prefill-chunk chunk, decode of --steps passes in the decode loop
  train/{dflash,dspine} (and --train-config files)   the jitted training step on a data x
      fsdp mesh of --mesh CPU devices, arguments sharded as the trainer shards them;
      the line adds the parameter, optimizer and frozen-target bytes per device
  kernel/...   each Pallas kernel at the target's shapes (and lax.top_k, which TPUs run
      where GPUs take `top_k`'s grouped or split paths)
One line per program: ok or FAIL with the error, and the Mosaic kernels its module holds
(distinct `tpu_custom_call` sites by kernel name). Exits 1 if any program fails.
--cost-table prints the per-TPU roofline table of docs/tpu.md instead (`tpu_roofline`).

Shape legend: B batch rows, T prefill chunk, PS page size, V vocab, D hidden.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import re
import sys
import time
from pathlib import Path
from typing import Callable

from dspine_benchmarks.abstract_models import (abstract_drafter, abstract_target, drafter_config,
                                                target_config)

DEFAULT_MESH = (4, 4)    # data x fsdp: 16 devices, as a v5e-16 / v6e-16 slice has chips


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    fn: Callable
    args: tuple
    note: str = ""           # printed after the kernels (the training step's bytes)


@dataclasses.dataclass(frozen=True)
class Result:
    name: str
    error: str | None
    kernels: collections.Counter
    seconds: float
    note: str = ""

    def line(self) -> str:
        if self.error is not None:
            return f"FAIL  {self.name}: {self.error}"
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(self.kernels.items()))
        mosaic = f"mosaic {sum(self.kernels.values())}" + (f" ({kinds})" if kinds else "")
        return "  ".join(filter(None, [f"ok    {self.name:46}", f"{mosaic:58}",
                                       f"{self.seconds:5.1f} s", self.note]))


def mosaic_kernels(module_text: str) -> collections.Counter:
    """Kernel name -> number of `tpu_custom_call` sites in a lowered module's text (a
    kernel called from a shared function counts once)."""
    names = collections.Counter()
    for line in module_text.splitlines():
        if "@tpu_custom_call(" in line:
            found = re.search(r'kernel_name = "([^"]*)"', line)
            names[found.group(1) if found else "?"] += 1
    return names


def lower(program: Program) -> Result:
    """Export `program` for the TPU platform; the error's first line when it fails."""
    import jax

    t0 = time.perf_counter()
    try:
        exported = jax.export.export(jax.jit(program.fn), platforms=("tpu",))(*program.args)
        kernels = mosaic_kernels(exported.mlir_module())
    except Exception as e:      # every failure is a finding: report it, go on to the next
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return Result(program.name, f"{type(e).__name__}: {first[:400]}",
                      collections.Counter(), time.perf_counter() - t0)
    return Result(program.name, None, kernels, time.perf_counter() - t0, program.note)


def run(programs, out=print) -> int:
    """Lower each program and print its line; 1 if any failed, else 0."""
    t0 = time.perf_counter()
    results = []
    for program in programs:
        results.append(lower(program))
        out(results[-1].line())
    failed = [r.name for r in results if r.error is not None]
    out(f"{len(results) - len(failed)} of {len(results)} programs lowered for TPU in "
        f"{time.perf_counter() - t0:.1f} s" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def struct(shape, dtype, sharding=None):
    import jax

    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


# ----- serving ------------------------------------------------------------------------------
def tpu_decoder(method: str, target, config, args):
    """The decoder `method` with the TPU kernels asked for by name: the pallas attention
    backend's Mosaic kernel, compiled (not interpreted, whatever the host), and DSpine's
    `vocab_top_k` TPU kernel."""
    from dspine_jax.attention.backend import PallasBackend
    from dspine_jax.engine import SpeculativeEngine
    from dspine_jax.generate import AutoregressiveGenerator

    options = dict(steps_per_call=args.steps, page_size=args.page_size,
                   attention_backend=PallasBackend("pallas_tpu", interpret=False))
    if method == "ar":
        return AutoregressiveGenerator(target, **options)
    drafter = abstract_drafter(drafter_config(config, method, args.draft_layers), target.dtype)
    return SpeculativeEngine(target, drafter, proposal_kernel="pallas_tpu", **options)


def prefill_program(decoder, sampling, num_pages: int, out_len: int, params, tokens, q_lens,
                    page_table, budget, rng, ignore_eos):
    """Empty caches, one chunk [B, T] prefilled, every row started: the offline batch's
    first program (the serving engine's prefill is the same call on caches it keeps)."""
    import jax.numpy as jnp

    caches = decoder.create_caches(page_table, num_pages)
    logits, caches = decoder.prefill(params, tokens, q_lens, caches)
    state = decoder.empty_state(caches, out_len)
    rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    return decoder.start(state, rows, logits, sampling, budget, rng, ignore_eos)


def decode_program(decoder, sampling, num_steps: int, params, state, ignore_eos):
    """`num_steps` target passes in the decode loop (`lax.while_loop`)."""
    return decoder.decode(params, state, sampling, ignore_eos, num_steps)


def serving_programs(config, args) -> list[Program]:
    import jax
    import jax.numpy as jnp

    from dspine_jax import row_keys
    from dspine_jax.page_pool import pages_needed
    from dspine_jax.sampling import SamplingParams

    target = abstract_target(config, jnp.bfloat16)
    b, t = args.batch, args.prefill_chunk
    out_len = 64
    # every row's pages for its chunk, the loop's passes and a verify block
    width = pages_needed(t + args.steps * 16 + 16 + out_len, args.page_size)
    num_pages = b * width
    rows = struct((b,), jnp.int32)
    rng = jax.eval_shape(row_keys.row_keys, struct((b,), jnp.uint32))
    flag = struct((), jnp.bool_)
    programs = []
    for method in ("ar", "dflash", "dspine"):
        decoder = tpu_decoder(method, target, config, args)
        params = decoder.params()
        for temperature in (0.0, args.temperature):
            sampling = SamplingParams.create(b, temperature, args.top_p if temperature else 1.0)
            prefill = functools.partial(prefill_program, decoder, sampling, num_pages, out_len)
            prefill_args = (params, struct((b, t), jnp.int32), rows, struct((b, width), jnp.int32),
                            rows, rng, flag)
            state = jax.eval_shape(prefill, *prefill_args)
            label = f"serve/{method}/%s T={temperature:g}"
            programs.append(Program(label % "prefill", prefill, prefill_args))
            programs.append(Program(label % "decode",
                                    functools.partial(decode_program, decoder, sampling,
                                                      args.steps),
                                    (params, state, flag)))
    return programs


# ----- training -----------------------------------------------------------------------------
def train_configs(config, args) -> list:
    """DFlash's and DSpine's default training configs at this target, then each
    --train-config file (its target's shapes are --target's)."""
    from dspine_train.config import from_dict, load_config

    configs = [(f"train/{kind}", from_dict({
        "drafter": {"kind": kind, "layers": args.draft_layers, "mask_token_id": 1},
        "data": {"seq_len": 512, "blocks_per_seq": 32},
        "run": {"batch_size": 32}})) for kind in ("dflash", "dspine")]
    for path in args.train_config:
        configs.append((f"train/{Path(path).stem}", load_config(Path(path))))
    return configs          # (main has read each file once already: errors are named there)


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (its shards)."""
    import jax
    import numpy as np

    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
               for x in jax.tree.leaves(tree))


def training_program(name: str, cfg, config, mesh) -> Program:
    """The jitted step of `dspine train` for `cfg` on `mesh`, its arguments abstract and
    sharded as the trainer shards them (parameters, optimizer state and the frozen target
    by the fsdp rule, the batch over data x fsdp)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from dspine_jax.attention.backend import XlaBackend
    from dspine_jax.checkpoints import resolve_dtype
    from dspine_train import sharding
    from dspine_train.optimizer import make_optimizer
    from dspine_train.step import make_step

    d = cfg.drafter
    dconfig = drafter_config(config, d.kind, d.layers, d.block_size, cfg.dspine)
    target = abstract_target(config, resolve_dtype(cfg.target.dtype if cfg.target.dtype != "auto"
                                                   else "bf16"))
    drafter = abstract_drafter(dconfig, jnp.float32)     # float32 master weights
    target_graph, target_params = nnx.split(target)
    drafter_graph, params, rest = nnx.split(drafter, nnx.Param, ...)
    tx, _ = make_optimizer(cfg)
    opt_state = jax.eval_shape(tx.init, params)
    fsdp = mesh.shape["fsdp"]

    def shard(tree):
        return jax.tree.map(lambda x: struct(x.shape, x.dtype, NamedSharding(
            mesh, sharding.param_spec(x.shape, fsdp))), tree)

    whole = NamedSharding(mesh, P())
    rows = sharding.batch_sharding(mesh)
    b, s = cfg.run.batch_size, cfg.data.seq_len
    if b % mesh.devices.size:
        raise SystemExit(f"{name}: run.batch_size {b} must divide over the "
                         f"{mesh.devices.size} devices of the mesh")
    key = jax.eval_shape(lambda: jax.random.key(0))
    step = make_step(cfg, target_graph, drafter_graph, tx, cfg.loss.resolve(dconfig), dconfig,
                     resolve_dtype(cfg.run.compute_dtype), mesh, target_attention=XlaBackend())
    args = (shard(target_params), shard(rest), shard(params), shard(opt_state),
            struct((), jnp.int32, whole), struct((), key.dtype, whole),
            struct((b, s), jnp.int32, rows), struct((b, s), jnp.bool_, rows))
    mib = lambda tree: per_device_bytes(tree) / 2 ** 20  # noqa: E731
    note = (f"per device: params {mib(args[2]):,.1f} MiB, optimizer {mib(args[3]):,.1f} MiB, "
            f"frozen target {mib(args[0]):,.1f} MiB")
    data, fsdp = mesh.shape["data"], mesh.shape["fsdp"]
    return Program(f"{name} mesh {data}x{fsdp}", step, args, note)


def training_programs(config, args) -> list[Program]:
    import jax

    from dspine_train import sharding

    data, fsdp = args.mesh
    devices = jax.devices("cpu")
    if len(devices) < data * fsdp:
        raise SystemExit(f"--mesh {data}x{fsdp} needs {data * fsdp} CPU devices, this process "
                         f"has {len(devices)}: run the command in a fresh process (it asks for "
                         "them before JAX starts)")
    mesh = sharding.make_mesh(data, fsdp, devices[:data * fsdp])
    return [training_program(name, cfg, config, mesh) for name, cfg in train_configs(config, args)]


# ----- kernels ------------------------------------------------------------------------------
def kernel_programs(config, args) -> list[Program]:
    """Each Pallas kernel alone at the target's shapes (bf16; f32 statistics)."""
    import jax
    import jax.numpy as jnp

    from dspine_jax.page_pool import pages_needed
    from pallas_kernels import lm_head_stats, ragged_paged_attention, vocab_top_k
    from pallas_kernels.top_k import top_k

    b, ps = args.batch, args.page_size
    n, kv, h = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    d, v = config.hidden_size, config.vocab_size
    bf16 = jnp.bfloat16
    width = pages_needed(args.context + args.prefill_chunk, ps)
    pool = struct((b * width, ps, kv, h), bf16)
    programs = []
    for what, t, mask in (("decode", 1, "causal"), ("verify", 16, "causal"),
                          ("draft", 16, "bidirectional"),
                          ("prefill", args.prefill_chunk, "causal")):
        attend = functools.partial(ragged_paged_attention, mask=mask,
                                   implementation="pallas_tpu")
        programs.append(Program(
            f"kernel/ragged_paged_attention {what} T={t}", attend,
            (struct((b, t, n, h), bf16), struct((b, t, kv, h), bf16),
             struct((b, t, kv, h), bf16), pool, pool, struct((b, width), jnp.int32),
             struct((b,), jnp.int32), struct((b,), jnp.int32))))
    slots = b * 15                                    # B rows x 15 drafted slots
    programs.append(Program(
        f"kernel/vocab_top_k R={slots} k=16",
        functools.partial(vocab_top_k, k=16, implementation="pallas_tpu"),
        (struct((slots, d), bf16), struct((v, d), bf16))))
    rows = 1024                       # a device's loss rows: 2 sequences x 32 blocks x 16
    stats = functools.partial(lm_head_stats, implementation="pallas_tpu")

    def loss_and_grad(hidden, weight, labels):
        def ce(hidden):
            lse, label_logit, rank = stats(hidden, weight, labels)
            return jnp.sum(lse - label_logit), rank
        return jax.value_and_grad(ce, has_aux=True)(hidden)

    programs.append(Program(f"kernel/lm_head_stats R={rows} forward+backward", loss_and_grad,
                            (struct((rows, d), bf16), struct((v, d), bf16),
                             struct((rows,), jnp.int32))))
    programs.append(Program(f"kernel/top_k R={slots} k=16 (XLA TopK)",
                            functools.partial(top_k, k=16), (struct((slots, v), jnp.float32),)))
    return programs


# ----- command line -------------------------------------------------------------------------
def parse_mesh(text: str) -> tuple[int, int]:
    from dspine_benchmarks.train_scaling import parse_mesh as parse

    return parse(text)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default="preset:smollm2-135m",
                   help="preset:NAME: a published model's shapes (random weights, abstract)")
    p.add_argument("--layers", type=int, default=None,
                   help="the target's depth (default: the preset's; >= 4)")
    p.add_argument("--draft-layers", type=int, default=5)
    p.add_argument("--only", nargs="+", default=["serve", "train", "kernel"],
                   choices=["serve", "train", "kernel"], help="which groups of programs")
    p.add_argument("--train-config", nargs="*", default=[], metavar="FILE",
                   help="training configs whose step to lower too (at --target's shapes)")
    p.add_argument("--mesh", type=parse_mesh, default=DEFAULT_MESH, metavar="DATAxFSDP",
                   help="the training mesh (default 4x4: 16 CPU devices)")
    p.add_argument("--batch", type=int, default=8, help="serving and kernel rows")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prefill tokens per row (dspine serve's --prefill-chunk default)")
    p.add_argument("--context", type=int, default=1024, help="kernel cache length")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=4, help="passes in the decode loop")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--cost-table", action="store_true",
                   help="print the per-TPU roofline tables of docs/tpu.md (serving at batch "
                        "1 and --context; each --train-config's run) and exit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from dspine_jax.errors import DSpineError
    from dspine_train.config import load_config

    args = parse_args(argv)
    config = target_config(args.target, args.layers)
    try:                          # a bad config file is named before anything is built
        configs = [(Path(path).stem, load_config(Path(path))) for path in args.train_config]
    except DSpineError as e:
        print(f"lower_for_tpu: {e}", file=sys.stderr)
        return 2
    if args.cost_table:
        from dspine_benchmarks.tpu_roofline import cost_table

        print(cost_table(config, draft_layers=args.draft_layers, context=args.context,
                         train_configs=configs))
        return 0
    import jax

    data, fsdp = args.mesh
    if "train" in args.only:      # before JAX starts its CPU backend
        try:
            jax.config.update("jax_num_cpu_devices", max(data * fsdp, 1))
        except RuntimeError:      # already started (an import ran JAX): checked below
            pass
    print(f"lowering for TPU on {jax.default_backend()} (jax {jax.__version__}): "
          f"{args.target}, {config.num_hidden_layers} layers", flush=True)
    groups = {"serve": serving_programs, "train": training_programs, "kernel": kernel_programs}
    programs = [p for group in args.only for p in groups[group](config, args)]
    return run(programs, out=functools.partial(print, flush=True))


if __name__ == "__main__":
    sys.exit(main())
