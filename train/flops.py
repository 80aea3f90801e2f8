"""Matmul FLOPs of one training step, and the peaks that MFU is counted against.

The count is the products a step's forward and backward passes compute (2 FLOPs per
multiply-add), each product once, for the drafter and loss it trains:
  * the frozen target's forward over every context token, through the layers the step
    reads: up to the deepest feature layer, or all of them when the loss needs the
    target's final hidden states (p_target: a CE+L1 backbone or DSpine's refinement);
  * the drafter: feature projection (weight gradient only: its input, the target's
    features, is frozen), context keys/values, its layers at the block slots (forward,
    input and weight gradients), the lm_head at the slots (forward and input gradient:
    the lm_head is the target's, frozen), the target's slot logits when p_target is needed;
  * DSpine: the injection after every layer (readout, gates, message, write), the
    refinement's rewrite of the last layer's slots with the true predecessor's code, the
    transfer codes (forward only; once for each term that places tokens in the space:
    the anchors, teacher replacement, the refinement, the alignment) and the alignment's
    readouts when that loss is on.
Not counted: the attention's score and value products (as is usual for MFU at these
lengths), recomputation in a backward pass, and terms under 0.1% of the step (the
candidates' scores). `tests/test_flops.py` checks the count against the matmuls of the
compiled step.

Shape legend: T context tokens (batch x seq_len), S block slots (batch x blocks x K),
H hidden, V vocab, r transfer rank, m message size.
"""

from __future__ import annotations

from dspine_jax.drafters.model import BlockDrafter

# bf16 dense peak (H100/H200 datasheet) for MFU; other platforms report none.
PEAK_FLOPS = {"gpu": 989e12}


def layer_macs(config) -> int:
    """Multiply-adds per token of one decoder layer's projections (q, k, v, o, MLP)."""
    h, hd = config.hidden_size, config.head_dim
    attention = h * hd * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    return attention + 3 * h * config.intermediate_size


def target_layers_run(target_config, drafter_config, loss) -> int:
    """The target layers a training step runs: XLA drops the layers after the deepest
    feature layer unless the loss reads the final hidden states."""
    if loss.reads_p_target:
        return target_config.num_hidden_layers
    return max(drafter_config.target_layer_ids) + 1


def flops_per_step(target_config, drafter: BlockDrafter, batch: int, seq_len: int,
                   blocks: int, loss) -> float:
    """Model matmul FLOPs of one step; `loss` is the step's resolved LossConfig."""
    dc = drafter.config
    tokens = batch * seq_len                                   # T
    slots = batch * blocks * dc.block_size                     # S
    h, v = dc.hidden_size, dc.vocab_size
    kv = dc.num_key_value_heads * dc.head_dim

    target = 2 * target_layers_run(target_config, dc, loss) * layer_macs(target_config) * tokens
    features = 4 * dc.num_features * h * h * tokens            # fc: forward + weight gradient
    context = 6 * dc.num_hidden_layers * 2 * h * kv * tokens   # each layer's context k, v
    layers = 6 * dc.num_hidden_layers * layer_macs(dc) * slots
    vocab = (4 + (2 if loss.reads_p_target else 0)) * v * h * slots
    return float(target + features + context + layers + vocab
                 + spine_flops(dc, slots, batch * blocks, loss))


def spine_flops(dc, slots: int, anchors: int, loss) -> int:
    """DSpine's own products (0 for DFlash), S slots and `anchors` blocks."""
    spine = dc.dspine
    if spine is None:
        return 0
    h, r, m = dc.hidden_size, spine.transfer_rank, spine.message_size
    write = r * m * 3 + m * h                                  # gates A, B, message M, W_l
    flops = 0
    if spine.injection:
        # readout R_l and the write, forward and both gradients, after every layer
        flops += 6 * dc.num_hidden_layers * (h * r + write) * slots
        flops += 2 * h * r * anchors                           # the anchors' codes
    if loss.refinement:
        # the last layer's write again, from the true predecessor's code: forward, the
        # weight gradients of the write and the readout, the input gradients of A, W_l and
        # the readout (the code is frozen). Its readout of the last layer's state is the
        # injection's (or, without injection, the alignment's) and so is A's product with it.
        readout = 0 if spine.injection or loss.alignment else h * r
        gates = 2 * r * m if spine.injection else 3 * r * m
        flops += (2 * (gates + m * h + readout) + 2 * (write + h * r)
                  + 2 * (r * m + m * h + h * r)) * slots
    # transfer codes (frozen, forward only) of the tokens each term places in the space
    uses = [loss.teacher_replacement and dc.injecting, loss.refinement, loss.alignment]
    flops += 2 * h * r * slots * sum(map(bool, uses))
    if loss.alignment:
        flops += 6 * dc.num_hidden_layers * h * r * slots      # readouts of each layer's output
    return flops
