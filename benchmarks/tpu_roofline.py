"""Per-TPU cost on paper: the bytes and FLOPs of an AR step and of a DSpine pass, and of
a training step, against the published peaks of TPU v5e, v5p and v6e.

`python -m dspine_benchmarks.lower_for_tpu --target preset:qwen3-8b --cost-table
[--train-config FILE ...]` prints the tables of docs/tpu.md.

The figures are counted from the shapes, not taken from XLA's cost analysis: a CPU host
has no TPU compiler to analyse the lowered programs with, the Mosaic kernels are custom
calls XLA's cost model does not see into, and the CPU's analysis of the same step counts
dead code (the drafter's unused [S, V] logits) and float32 copies the TPU never makes.
The count, per pass (bf16 weights and caches, 2 bytes):
  bytes   every weight a matmul reads, once (the input embedding is a gather of B rows;
          DSpine's proposal reads the lm_head again for its top-C), plus the KV caches
          read up to each row's length (target and drafter context);
  FLOPs   2 per weight per token, attention's QK and PV (4 x heads x head dim x keys
          per query), DSpine's C x C transition table.
A step's roofline time is max(bytes / HBM bandwidth, FLOPs / bf16 peak) on one chip:
a lower bound that assumes the weights and caches fit in its HBM (the serving engine
runs on one device). The training step's FLOPs are `dspine_train.flops.flops_per_step`'s
(matmul FLOPs, the MFU numerator), over the chips of a slice.

Shape legend: B batch, c context (cached positions), K block, S = K - 1 drafted slots,
C candidates, L/Ld target/drafter layers, N heads, Kh kv heads, H head dim, D hidden,
V vocab, F fused features, r transfer rank, m message size.
"""

from __future__ import annotations

import dataclasses

BYTES = 2  # bf16


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    peak_flops: float      # dense bf16 FLOP/s
    hbm_bandwidth: float   # bytes/s
    hbm_bytes: float
    source: str


# Google Cloud's TPU pages (bf16 peak per chip; HBM capacity and bandwidth per chip).
TPUS = (
    Chip("v5e", 197e12, 819e9, 16e9, "https://cloud.google.com/tpu/docs/v5e"),
    Chip("v5p", 459e12, 2765e9, 95e9, "https://cloud.google.com/tpu/docs/v5p"),
    Chip("v6e", 918e12, 1638e9, 32e9, "https://cloud.google.com/tpu/docs/v6e"),
)
# The H200 the GPU benchmarks ran on (NVIDIA's datasheet: 4.8 TB/s HBM3e, 989 TFLOP/s
# dense bf16), for comparison with its measured steps.
H200 = Chip("H200", 989e12, 4.8e12, 141e9, "https://www.nvidia.com/en-us/data-center/h200/")


@dataclasses.dataclass(frozen=True)
class Cost:
    bytes: float
    flops: float

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.bytes + other.bytes, self.flops + other.flops)

    def seconds(self, chip: Chip) -> float:
        return max(self.bytes / chip.hbm_bandwidth, self.flops / chip.peak_flops)


def matmul_params(config) -> int:
    """Weights a target pass multiplies by: all but an untied input embedding (gathered)."""
    untied_embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return config.num_params() - untied_embedding


def attention(layers: int, batch: int, queries: int, keys: int, config) -> Cost:
    """Reading `keys` cached positions of K and V per layer and row; QK and PV FLOPs."""
    kv_bytes = 2 * layers * batch * keys * config.num_key_value_heads * config.head_dim * BYTES
    flops = 4 * layers * batch * queries * keys * config.num_attention_heads * config.head_dim
    return Cost(kv_bytes, flops)


def target_pass(config, batch: int, tokens: int, context: int) -> Cost:
    """The target over `tokens` new tokens per row after `context` cached ones."""
    weights = matmul_params(config)
    return Cost(weights * BYTES, 2 * weights * batch * tokens) + attention(
        config.num_hidden_layers, batch, tokens, context + tokens, config)


def ar_step(config, batch: int = 1, context: int = 1024) -> Cost:
    return target_pass(config, batch, 1, context)


def drafter_param_groups(dconfig) -> dict[str, int]:
    """Parameters of a drafter by role: the layer stack (with DSpine's injection), the
    fc over the target's features, the transfer basis."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dspine_benchmarks.abstract_models import abstract_drafter

    groups = {"layers": 0, "fc": 0, "transfer": 0}
    flat = nnx.to_flat_state(nnx.state(abstract_drafter(dconfig, jnp.float32)))
    for path, var in flat:
        size = int(np.prod(jax.tree.leaves(var)[0].shape))
        head = str(path[0])
        groups["fc" if head in ("fc", "hidden_norm") else
               "transfer" if head.startswith("transfer") else "layers"] += size
    return groups


def dspine_pass(config, dconfig, batch: int = 1, context: int = 1024) -> dict[str, Cost]:
    """One DSpine pass by stage: draft (the drafter over [anchor, MASK...] against its
    context), proposal (vocab_top_k over the lm_head, the C x C table), verify (the
    target over the block) and accept (the context grows by the block's features)."""
    k = dconfig.block_size
    s, c = k - 1, dconfig.dspine.top_k
    d, v = config.hidden_size, config.vocab_size
    r, m = dconfig.dspine.transfer_rank, dconfig.dspine.message_size
    groups = drafter_param_groups(dconfig)
    layer_kv = 2 * d * dconfig.num_key_value_heads * dconfig.head_dim   # k_proj + v_proj
    draft = Cost(groups["layers"] * BYTES, 2 * groups["layers"] * batch * k) + attention(
        dconfig.num_hidden_layers, batch, k, context + k, dconfig.layer_config())
    table_flops = 2 * c * (d * r + 3 * r * m + m * d + c * d) * batch * s
    proposal = Cost(v * d * BYTES + groups["transfer"] * 4, 2 * batch * s * v * d + table_flops)
    extend = groups["fc"] + dconfig.num_hidden_layers * layer_kv
    accept = Cost(extend * BYTES, 2 * extend * batch * k)
    return {"draft": draft, "proposal": proposal,
            "verify": target_pass(config, batch, k, context), "accept": accept}


def fits(cost_bytes: float, chip: Chip) -> str:
    return "yes" if cost_bytes < chip.hbm_bytes else f"no ({chip.hbm_bytes / 1e9:.0f} GB)"


def serving_table(config, draft_layers: int = 5, context: int = 1024) -> str:
    from dspine_jax.drafters.config import DrafterConfig

    dconfig = DrafterConfig.for_target(config, kind="dspine", num_layers=draft_layers,
                                       mask_token_id=1)
    step = ar_step(config, 1, context)
    stages = dspine_pass(config, dconfig, 1, context)
    spine = sum(stages.values(), Cost(0, 0))
    weights = config.num_params() * BYTES
    lines = [
        f"Batch 1, context {context}, bf16; DSpine: {draft_layers} drafter layers at the "
        f"target's width, block {dconfig.block_size}, r {dconfig.dspine.transfer_rank}, "
        f"m {dconfig.dspine.message_size}, C {dconfig.dspine.top_k} (counted, "
        "`dspine_benchmarks.tpu_roofline`).", "",
        "| program | GB read | GFLOP | FLOP/byte |", "|---|---|---|---|",
        f"| AR step | {step.bytes / 1e9:.2f} | {step.flops / 1e9:.1f} | "
        f"{step.flops / step.bytes:.1f} |"]
    for name, cost in stages.items():
        lines.append(f"| DSpine pass: {name} | {cost.bytes / 1e9:.2f} | {cost.flops / 1e9:.1f} "
                     f"| {cost.flops / cost.bytes:.1f} |")
    lines += [f"| DSpine pass | {spine.bytes / 1e9:.2f} | {spine.flops / 1e9:.1f} | "
              f"{spine.flops / spine.bytes:.1f} |", "",
              "| chip | bf16 TFLOP/s | HBM GB/s | AR step (ms) | DSpine pass (ms) | pass / step "
              "| x AR at tau 3 | x AR at tau 5 | target weights fit one chip |",
              "|---|---|---|---|---|---|---|---|---|"]
    for chip in (*TPUS, H200):
        t_step, t_pass = step.seconds(chip), spine.seconds(chip)
        ratio = t_pass / t_step
        lines.append(f"| {chip.name} | {chip.peak_flops / 1e12:.0f} | "
                     f"{chip.hbm_bandwidth / 1e9:.0f} | {t_step * 1e3:.2f} | "
                     f"{t_pass * 1e3:.2f} | {ratio:.2f} | {3 / ratio:.2f} | {5 / ratio:.2f} | "
                     f"{fits(weights, chip)} |")
    return "\n".join(lines)


def training_table(config, train_configs, slices=((TPUS[0], 16), (TPUS[1], 16),
                                                  (TPUS[2], 16))) -> str:
    """Roofline hours of each config's run.steps on slices of `chips` chips (compute
    bound: the step's matmul FLOPs over the slice's bf16 peak)."""
    import jax.numpy as jnp

    from dspine_benchmarks.abstract_models import abstract_drafter, drafter_config
    from dspine_train.flops import flops_per_step

    lines = ["| config | steps | batch x seq | TFLOP per step | "
             + " | ".join(f"{chip.name}-{n * (2 if chip.name == 'v5p' else 1)} "
                          f"({n} chips): hours at peak" for chip, n in slices) + " |",
             "|---|---|---|---|" + "---|" * len(slices)]
    for name, cfg in train_configs:
        d = cfg.drafter
        drafter = abstract_drafter(drafter_config(config, d.kind, d.layers, d.block_size,
                                                  cfg.dspine), jnp.float32)
        flops = flops_per_step(config, drafter, cfg.run.batch_size, cfg.data.seq_len,
                               cfg.data.blocks_per_seq, cfg.loss.resolve(drafter.config))
        hours = [cfg.run.steps * flops / (n * chip.peak_flops) / 3600 for chip, n in slices]
        lines.append(f"| {name} | {cfg.run.steps:,} | {cfg.run.batch_size} x "
                     f"{cfg.data.seq_len} | {flops / 1e12:.0f} | "
                     + " | ".join(f"{h:.2f}" for h in hours) + " |")
    return "\n".join(lines)


def cost_table(config, *, draft_layers: int = 5, context: int = 1024,
               train_configs=()) -> str:
    out = serving_table(config, draft_layers, context)
    if train_configs:
        out += "\n\n" + training_table(config, train_configs)
    return out
