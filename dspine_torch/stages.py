"""The PyTorch stage record of one prompt, for parity checks against the JAX side.

Keys and shapes are those of `dspine_jax.parity` (which writes the JAX record and the
golden fixtures); this module only computes, it compares nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from dspine_torch.modeling_dspine import DFlashDraftModel, warp_logits
from dspine_torch.speculative import Sampling, TargetRunner, generate


@torch.no_grad()
def torch_stages(target_model, drafter: DFlashDraftModel, prompt: list[int], *,
                 max_new_tokens: int = 16, q_temperature: float = 0.8) -> dict[str, np.ndarray]:
    target = TargetRunner(target_model, drafter.target_layer_ids)
    try:
        e_in, e_out = target.input_embedding(), target.output_embedding()
        logits, features = target(torch.tensor([prompt]))
        first = logits[0, -1].argmax()[None]                              # [1]
        context = drafter.extend_context(drafter.new_context(1), features)
        out = drafter(first, context, e_in, e_out)
        proposal = drafter.propose(out, first, e_out)                  # T = 0
        record = {"features": features[0], "first_token": first[0],
                  "draft_logits": out.logits[0], "draft_tokens": proposal.tokens[0]}
        if proposal.table is not None:
            record["candidates"] = proposal.candidates[0]
            record["transition"] = proposal.table[0]
            record["q"] = torch.softmax(warp_logits(proposal.table, q_temperature), -1)[0]
        else:
            record["q"] = torch.softmax(warp_logits(out.logits[:, 1:], q_temperature), -1)[0]
        if out.gates is not None:
            record["gates"] = out.gates
        block = torch.cat([first, proposal.tokens[0]])[None]
        target_logits = target(block)[0][0]                            # [K, V]
        record["target_logits"] = target_logits
        matches = (proposal.tokens[0] == target_logits[:-1].argmax(-1)).int()
        record["num_accepted"] = torch.cumprod(matches, 0).sum()
    finally:
        target.close()
    gen = generate(target_model, drafter, prompt, max_new_tokens=max_new_tokens,
                   sampling=Sampling(), ignore_eos=True)
    record["tokens"] = torch.tensor(gen.tokens)
    record["accept_lengths"] = torch.tensor(gen.accept_lengths)
    out = {}
    for k, v in record.items():
        v = v.detach()
        out[k] = v.float().numpy() if v.is_floating_point() else v.numpy().astype(np.int32)
    return out
