"""Golden fixtures for the PyTorch port, written by the JAX side.

    PYTHONPATH=. python -m tests.torch_port_golden             # rewrite the .npz records
    PYTHONPATH=. python -m tests.torch_port_golden --weights   # also rebuild the weights

tests/fixtures/torch_port/ holds a tiny random Qwen3 target (built with transformers,
seed 0), a DFlash and a DSpine drafter built by dspine_jax (fixed seeds; DSpine's writes,
predecessor gate and bias made non-zero so the injection changes the output) in the
export layout, and one stage record per drafter and prompt (`dspine_jax.parity`) in
golden_{kind}.npz under keys "p{prompt}/{stage}". The PyTorch tests read these files
without running JAX; `test_jax_side_reproduces_the_golden_records` reruns this
computation and fails if the JAX side drifts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures" / "torch_port"
# Prefixes of two of the drafters' training sequences (so drafts get accepted), and
# one unseen prompt.
PROMPTS = [[37, 11, 12, 8, 23, 68, 39, 23], [31, 73, 11, 5, 30, 30, 38, 21, 57, 30],
           [70, 3, 33, 88, 14, 51, 27, 62, 19, 45, 6, 80]]
MAX_NEW_TOKENS = 24
Q_TEMPERATURE = 0.8
KINDS = ("dflash", "dspine")
TARGET = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.2,
              rope_theta=1e6, tie_word_embeddings=False)


def build_weights(folder: Path = FIXTURES) -> None:
    """The target (transformers) and both drafters (dspine_jax), saved in f32."""
    import jax
    import torch
    import transformers

    from dspine_jax.checkpoints import load_target
    from dspine_jax.drafters.checkpoint import save_drafter
    from dspine_jax.drafters.config import DrafterConfig, DSpineConfig
    from dspine_jax.drafters.model import BlockDrafter

    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TARGET)).float().eval()
    model.save_pretrained(folder / "target")
    target = load_target(str(folder / "target"), dtype="f32", with_tokenizer=False)
    # The target's own greedy continuations of random prompts: the drafters' training data.
    prompts = torch.randint(0, TARGET["vocab_size"], (128, 4), generator=torch.Generator()
                            .manual_seed(1))
    sequences = model.generate(prompts, attention_mask=torch.ones_like(prompts),
                               max_new_tokens=36, do_sample=False, min_new_tokens=36,
                               pad_token_id=0, eos_token_id=None).numpy()
    spine = DSpineConfig(transfer_rank=16, message_size=8, top_k=4)
    for kind in KINDS:
        config = DrafterConfig.for_target(target.config, kind=kind, num_layers=2,
                                          mask_token_id=3, block_size=5, dspine=spine)
        e_out = target.model.output_embedding()
        drafter = BlockDrafter.create(config, e_out, seed=1)
        if kind == "dspine":
            keys = iter(jax.random.split(jax.random.key(2), 8))
            inj = drafter.injection
            for w in [*inj.writes, inj.predecessor_gate]:
                w.weight[...] = jax.random.normal(next(keys), w.weight.shape) * 0.3
            inj.bias[...] = jax.random.normal(next(keys), inj.bias.shape) * 0.3
        print(kind, 'final training loss', fit(drafter, target.model, sequences))
        save_drafter(drafter, folder / kind,
                     code_table=drafter.code_table(e_out) if kind == "dspine" else None)


def fit(drafter, target, sequences, steps: int = 1500, blocks: int = 8, seed: int = 0):
    """A few hundred Adam steps of per-slot cross-entropy (enough for accepted lengths
    above 1, so the fixtures exercise acceptance, cache rollback and context growth)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    k = drafter.config.block_size
    tokens = jnp.asarray(sequences, jnp.int32)
    out = target(tokens, hidden_layer_ids=drafter.config.target_layer_ids)
    feats = out.features()
    e_in, e_out = target.input_embedding(), target.output_embedding()
    graph, params, rest = nnx.split(drafter, nnx.Param, ...)
    tx = optax.adam(optax.cosine_decay_schedule(1e-2, steps))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, rows, anchors):
        def loss_fn(p):
            model = nnx.merge(graph, p, rest)
            logits = model.forward_train(tokens[rows], feats[rows], anchors, e_in,
                                         e_out).logits[:, :, 1:]
            labels = jnp.take_along_axis(
                tokens[rows], (anchors[..., None] + jnp.arange(1, k)).reshape(len(rows), -1),
                1).reshape(logits.shape[:-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    t = tokens.shape[1]
    for _ in range(steps):
        rows = jnp.asarray(rng.choice(len(sequences), 16, replace=False))
        anchors = np.sort(np.stack([rng.choice(t - k + 1, blocks, replace=False)
                                    for _ in range(16)]), 1)
        params, opt_state, loss = step(params, opt_state, rows, jnp.asarray(anchors))
    nnx.update(drafter, params)
    return float(loss)


def records(folder: Path = FIXTURES, kind: str = "dflash", dtype: str = "f32") -> dict:
    """{"p{i}/{stage}": array} for every prompt, computed by dspine_jax."""
    from dspine_jax.checkpoints import load_target, resolve_dtype
    from dspine_jax.drafters.checkpoint import load_drafter
    from dspine_jax.parity import jax_stages

    target = load_target(str(folder / "target"), dtype=dtype, with_tokenizer=False)
    drafter = load_drafter(folder / kind, dtype=resolve_dtype(dtype))
    out = {}
    for i, prompt in enumerate(PROMPTS):
        stages = jax_stages(target.model, drafter, prompt, max_new_tokens=MAX_NEW_TOKENS,
                            q_temperature=Q_TEMPERATURE)
        out.update({f"p{i}/{k}": v for k, v in stages.items()})
    return out


def unpack(flat: dict, prompt: int) -> dict:
    prefix = f"p{prompt}/"
    return {k[len(prefix):]: np.asarray(v) for k, v in flat.items() if k.startswith(prefix)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", action="store_true", help="rebuild the weights too")
    args = parser.parse_args()
    FIXTURES.mkdir(parents=True, exist_ok=True)
    if args.weights:
        build_weights()
    for kind in KINDS:
        np.savez_compressed(FIXTURES / f"golden_{kind}.npz", **records(kind=kind))
    meta = {"prompts": PROMPTS, "max_new_tokens": MAX_NEW_TOKENS,
            "q_temperature": Q_TEMPERATURE, "target": TARGET}
    (FIXTURES / "golden.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
