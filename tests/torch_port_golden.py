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
import dataclasses
import json
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures" / "torch_port"
PROMPTS = [[5, 17, 42, 8, 61, 23, 9], [70, 3, 33, 88, 14, 51, 27, 62, 19, 45, 6, 80]]
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
        save_drafter(drafter, folder / kind,
                     code_table=drafter.code_table(e_out) if kind == "dspine" else None)


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
