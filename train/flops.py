"""Matmul FLOPs of one training step, and the peaks that MFU is counted against."""

from __future__ import annotations

from dspine_jax.drafters.model import BlockDrafter

# bf16 dense peak (H100/H200 datasheet) for MFU; other platforms report none.
PEAK_FLOPS = {"gpu": 989e12}


def flops_per_step(target_config, drafter: BlockDrafter, batch: int, seq_len: int,
                   blocks: int) -> float:
    """Matmul FLOPs: target forward, drafter forward + backward over the block tokens and
    the context projections, and the vocabulary products."""
    dc = drafter.config
    block_tokens = batch * blocks * dc.block_size
    h, v = dc.hidden_size, dc.vocab_size
    layer = (h * dc.head_dim * (2 * dc.num_attention_heads + 2 * dc.num_key_value_heads)
             + 3 * h * dc.intermediate_size)
    context = dc.num_features * h * h + dc.num_hidden_layers * 2 * h * dc.num_key_value_heads \
        * dc.head_dim
    # Embedding rows are gathered, not multiplied, and the target's lm_head is not run.
    embeddings = target_config.vocab_size * target_config.hidden_size * (
        1 if target_config.tie_word_embeddings else 2)
    target = 2 * (target_config.num_params() - embeddings) * batch * seq_len
    drafter_flops = 6 * dc.num_hidden_layers * layer * block_tokens + 6 * context * batch * seq_len
    vocab = (4 + 2) * v * h * block_tokens  # drafter logits fwd+bwd, target slot logits
    return float(target + drafter_flops + vocab)
