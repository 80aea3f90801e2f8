"""SGLang plugin: the DSPINE speculative algorithm.

DSpine runs on SGLang's DFlash machinery (its `DFlashWorkerV2`: the paged draft KV
cache filled from target features, the block draft pass, CUDA graphs, the verify with
sparse q over candidates). The plugin adds what DSpine changes:

* the draft model `DSpineDraftModel` (the architecture `dspine export` writes): SGLang's
  DFlash draft model plus DSpine's gated adjacent injection after every layer
  (`dspine_torch.kernels.gated_injection`, Triton on CUDA), keeping the last layer's
  pre-injection state;
* DSpine's decoding head as the draft model's `candidate_selector`, the hook SGLang's
  DFlash worker already drives for candidate-lattice drafters: `compute_candidates` is
  the top-C over the target's lm_head (`dspine_proposal.vocab_topk`), `build_lattice`
  the C x C transition table (`dspine_proposal.transition_table`), and `sample_path`
  the walk with each row's full warp (`selector_walk`: argmax on greedy rows, else
  temperature, top-k, top-p through `dspine_torch.kernels.common.warp_logits`, the
  function the kernels' reference applies and the warp SGLang's verify gives p; q over
  the candidates);
* the algorithm name DSPINE, registered through `SpeculativeAlgorithm.register` with a
  spec class that answers every `is_*` / `supports_*` question as DFLASH does (DSpine is
  a DFlash-family algorithm to SGLang's scheduler).

Registration runs through SGLang's plugin entry point (group `sglang.srt.plugins`, name
`dspine`, declared in pyproject.toml), or by calling `register()` before SGLang starts
(`python -m dspine_torch.sglang_plugin <launch_server arguments>` does that and then runs
SGLang's server). The drafter folder is a `dspine export --format dflash-hf` export (it
carries the [V, r] `transfer_codes` table the injection reads).

SGLang hands the walk each row's temperature and greedy flag only, so the plugin's
worker (a `DFlashWorkerV2` subclass) stages each batch's top_p/top_k into the selector
beside them, on the eager path and before a captured draft graph's replay.

Limits: tensor parallelism 1 for the draft head (the lm_head rows are read whole).

    python -m dspine_torch.sglang_plugin --model-path Qwen/Qwen3-8B \\
        --speculative-algorithm DSPINE --speculative-draft-model-path EXPORT_DIR \\
        --speculative-num-draft-tokens 16 --dtype bfloat16
"""

from __future__ import annotations

import math

ALGORITHM = "DSPINE"
ARCHITECTURE = "DSpineDraftModel"
# Methods of the spec class that must not answer as DFLASH does.
_OWN = {"is_some", "is_none", "is_speculative", "create_worker", "is_dflash"}

_registered = False


def kernel_implementation(tensor) -> str:
    return "triton" if tensor.is_cuda else "torch"


def spec_class():
    """A CustomSpecAlgo that answers SGLang's scheduler as DFLASH does."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    dflash = SpeculativeAlgorithm.DFLASH

    def delegate(name):
        def method(self, *args, **kwargs):
            return getattr(dflash, name)(*args, **kwargs)
        method.__name__ = name
        return method

    names = {n for n in vars(SpeculativeAlgorithm)
             if n.startswith(("is_", "supports_", "has_", "carries_", "need_"))
             or n in ("handle_server_args", "resolve_max_speculative_num_draft_tokens",
                      "get_num_tokens_per_req_for_target_verify", "create_future_map",
                      "build_disagg_draft_input")}
    body = {n: delegate(n) for n in names - _OWN if callable(getattr(dflash, n, None))}
    body["is_dflash"] = lambda self: True
    body["__doc__"] = "DSPINE: a DFlash-family algorithm to SGLang's scheduler."
    return type("DSpineSpecAlgo", (CustomSpecAlgo,), body)


def worker_factory(server_args):
    """SGLang's DFlash worker, staging each batch's top_p/top_k for DSpine's walk (the
    rest of DSpine's difference lives in its draft model)."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    return worker_class(DFlashWorkerV2)


def worker_class(base):
    class DSpineWorker(base):
        """`base` (SGLang's DFlashWorkerV2), plus the top_p/top_k of each batch staged
        into the selector wherever SGLang stages the temperatures."""

        def _propose_selector_block(self, *, bs, sampling_info, **kwargs):
            _stage(self.selector, bs, sampling_info)
            return super()._propose_selector_block(bs=bs, sampling_info=sampling_info,
                                                   **kwargs)

        def _maybe_build_draft_sampler(self):
            sampler = super()._maybe_build_draft_sampler()
            stage = getattr(sampler, "stage_sampling_params", None)
            selector = self.selector
            if stage is None or not hasattr(selector, "stage_warp"):
                return sampler
            # The captured graph reads fixed addresses: reserve them before capture.
            selector.reserve(sampler.temperatures.shape[0], sampler.temperatures.device)

            def stage_both(*, bs, sampling_info):
                stage(bs=bs, sampling_info=sampling_info)
                selector.stage_warp(bs, sampling_info)
            sampler.stage_sampling_params = stage_both
            return sampler

    DSpineWorker.__name__ = "DSpineWorker"
    return DSpineWorker


def _stage(selector, bs, sampling_info):
    if hasattr(selector, "stage_warp"):
        selector.stage_warp(bs, sampling_info)


class RowWarp:
    """Each row's top_p / top_k for the walk, staged by the worker beside SGLang's own
    temperatures. Copied in place into buffers reserved once, so a captured draft graph
    reads them at fixed addresses; rows never staged get no top-p/top-k."""

    def __init__(self):
        self.top_ps = self.top_ks = None

    def reserve(self, rows: int, device) -> None:
        import torch

        device = torch.device(device)
        have = self.top_ps
        if (have is not None and have.shape[0] >= rows and have.device.type == device.type
                and (device.index is None or have.device.index == device.index)):
            return
        self.top_ps = torch.ones(rows, device=device)
        self.top_ks = torch.zeros(rows, dtype=torch.long, device=device)

    def stage(self, bs: int, sampling_info, device) -> None:
        self.reserve(bs, device if self.top_ps is None else self.top_ps.device)
        if sampling_info is None:
            self.top_ps[:bs].fill_(1.0)
            self.top_ks[:bs].fill_(0)
            return
        self.top_ps[:bs].copy_(sampling_info.top_ps.view(-1)[:bs].float())
        self.top_ks[:bs].copy_(sampling_info.top_ks.view(-1)[:bs].long())

    def rows(self, bs: int, device):
        """(top_ps [bs], top_ks [bs]) for the walk."""
        if self.top_ps is None or self.top_ps.shape[0] < bs:
            self.reserve(bs, device)
        return self.top_ps[:bs], self.top_ks[:bs]


def selector_walk(candidate_ids, scores, uniforms, temperatures, greedy_mask, top_ps, top_ks):
    """DSpine's walk with every row's own warp (plain torch; what `sample_path` runs).

    candidate_ids [B, S, C]; scores [B, S, C, C] (slot 0's rows all score from the
    anchor); uniforms [B, S]; temperatures, top_ps [B] float; top_ks [B] int (<= 0 or
    >= C: all candidates); greedy_mask [B] bool -> (tokens [B, S], q [B, S, C]).
    A sampled row draws slot i from softmax(warp(row of its chosen predecessor)) at
    uniforms[:, i] (`kernels.common.warp_logits` and `inverse_cdf`, as the kernels'
    reference walk does); a greedy row takes the argmax, with q its point mass."""
    import torch
    import torch.nn.functional as F

    from dspine_torch.kernels.common import inverse_cdf, warp_logits

    b, s, c, _ = scores.shape
    rows = torch.arange(b, device=scores.device)
    index = torch.zeros(b, dtype=torch.long, device=scores.device)
    tokens, qs = [], []
    for i in range(s):
        given = scores[rows, i, index].float()                             # [B, C]
        probs = torch.softmax(warp_logits(given, temperatures, top_ps, top_ks), -1)
        greedy = given.argmax(-1)
        index = torch.where(greedy_mask, greedy, inverse_cdf(probs, uniforms[:, i]))
        qs.append(torch.where(greedy_mask[:, None], F.one_hot(greedy, c).float(), probs))
        tokens.append(candidate_ids[rows, i, index])
    return torch.stack(tokens, 1), torch.stack(qs, 1)


def register() -> None:
    """Register the DSPINE algorithm and the DSpineDraftModel architecture (idempotent):
    SGLang's plugin entry point."""
    global _registered
    if _registered:
        return
    register_algorithm()
    register_model()
    _registered = True


def register_algorithm() -> None:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    try:
        SpeculativeAlgorithm.from_string(ALGORITHM)
    except ValueError:
        SpeculativeAlgorithm.register(ALGORITHM, supports_overlap=True,
                                      spec_class=spec_class())(worker_factory)


def register_model() -> None:
    from sglang.srt.models.registry import ModelRegistry

    ModelRegistry.get_supported_archs()                       # load the built-in models
    ModelRegistry.models.setdefault(ARCHITECTURE, draft_model_class())


def draft_model_class():
    """SGLang's DFlash draft model with DSpine's injection and decoding head."""
    import torch
    from torch import nn

    from sglang.srt.models.dflash import DFlashDraftModel

    from dspine_torch.kernels import dspine_proposal, gated_injection
    from dspine_torch.modeling_dspine import AdjacentInjection

    class DSpineSelector(nn.Module):
        """DSpine's head behind SGLang's candidate-selector interface."""

        def __init__(self, model, top_k: int):
            super().__init__()
            self.top_k = int(top_k)
            self._model = [model]           # not a submodule: no second owner
            self.warp = RowWarp()

        def reserve(self, rows: int, device) -> None:
            self.warp.reserve(rows, device)

        def stage_warp(self, bs: int, sampling_info) -> None:
            self.warp.stage(bs, sampling_info, self._model[0].transfer_codes.device)

        def head(self):
            m = self._model[0]
            inj, last = m.injection, len(m.layers) - 1
            return dspine_proposal.ChainHead(
                readout=inj.readouts[last].weight, receiver_gate=inj.receiver_gate.weight,
                predecessor_gate=inj.predecessor_gate.weight, bias=inj.bias,
                message=inj.message.weight, write=inj.writes[last].weight,
                norm_weight=m.norm.weight, eps=float(m.norm.variance_epsilon),
                code_table=m.transfer_codes)

        def build_lattice(self, *, candidate_ids, unary_logits, hidden_states,
                          anchor_token_ids):
            """candidate_ids [B, S, C] -> the transition table [B, S, C, C] (the unary
            logits are not used: DSpine scores each candidate given its predecessor)."""
            m = self._model[0]
            b, s, c = candidate_ids.shape
            d = m._pre_injection.shape[-1]
            pre = m._pre_injection.view(b, s + 1, d)[:, 1:].reshape(b * s, d)
            preds = torch.cat([anchor_token_ids.view(b, 1, 1).expand(b, 1, c),
                               candidate_ids[:, :-1]], 1).reshape(b * s, c)
            lm_head = m.lm_head.weight
            head = self.head()
            gu = dspine_proposal.gated_messages(head, pre, preds, lm_head)
            table = dspine_proposal.transition_table(
                head, pre, gu, candidate_ids.reshape(b * s, c), lm_head,
                implementation=kernel_implementation(pre))
            return table.view(b, s, c, c)

        def sample_path(self, *, candidate_ids, scores, uniforms, temperatures,
                        greedy_mask):
            """SGLang's hook: the walk with each row's staged top_p / top_k."""
            top_ps, top_ks = self.warp.rows(scores.shape[0], scores.device)
            return selector_walk(candidate_ids, scores, uniforms, temperatures.view(-1),
                                 greedy_mask.view(-1), top_ps, top_ks)

    class DSpineDraftModel(DFlashDraftModel):
        def __init__(self, config, quant_config=None, prefix: str = "") -> None:
            super().__init__(config=config, quant_config=quant_config, prefix=prefix)
            spine = dict(getattr(config, "dspine_config", None) or {})
            switches = dict(getattr(config, "dspine_jax_switches", None) or {})
            self.rank = int(spine["transfer_rank"])
            self.inject_enabled = switches.get("injection", True)
            self.injection = AdjacentInjection(int(config.hidden_size), self.rank,
                                               int(spine["message_size"]),
                                               int(config.num_hidden_layers))
            self.register_buffer("transfer_codes", torch.zeros(int(config.vocab_size),
                                                               self.rank))
            self._pre_injection = None
            self.lm_head = None             # the worker attaches the target's
            if switches.get("refinement_head", True):
                self.candidate_selector = DSpineSelector(self, spine.get("top_k", 16))

        def compute_candidates(self, hidden):
            """Top-C over the target's lm_head: hidden [N, D] -> (ids, logits) [N, C]."""
            values, ids = dspine_proposal.vocab_topk(
                hidden, self.lm_head.weight, self.candidate_selector.top_k,
                implementation=kernel_implementation(hidden))
            return ids, values

        def forward(self, input_ids, positions, forward_batch, input_embeds=None,
                    get_embedding: bool = False, pp_proxy_tensors=None):
            from sglang.srt.layers.logits_processor import LogitsProcessorOutput

            if input_embeds is None:
                input_embeds = (self.embed_tokens(input_ids) if self.embed_tokens is not None
                                else self.forward_embed(input_ids))
            hidden, residual = input_embeds, None
            n, d = hidden.shape[0], hidden.shape[-1]
            k = self.block_size
            blocks = n > 0 and n % k == 0
            if blocks:
                anchor = input_ids.view(n // k, k)[:, 0]
                code = math.sqrt(self.rank) * self.transfer_codes.float()[anchor]
            for i, layer in enumerate(self.layers):
                hidden, residual = layer(positions, hidden, forward_batch, residual)
                if not blocks:
                    continue
                h = hidden if residual is None else hidden + residual      # the stream
                self._pre_injection = h
                if self.inject_enabled:
                    inj = self.injection
                    h, _ = gated_injection.inject(
                        h.view(n // k, k, d), code, inj.readouts[i].weight,
                        inj.receiver_gate.weight, inj.predecessor_gate.weight, inj.bias,
                        inj.message.weight, inj.writes[i].weight,
                        implementation=kernel_implementation(h))
                    h = h.view(n, d)
                hidden, residual = h, None
            if hidden.numel() != 0:
                hidden = (self.norm(hidden) if residual is None
                          else self.norm(hidden, residual)[0])
            return LogitsProcessorOutput(next_token_logits=None, hidden_states=hidden)

        def load_weights(self, weights):
            own = {}
            rest = []
            for name, tensor in weights:
                if name.startswith(("injection.", "transfer_")):
                    own[name] = tensor
                else:
                    rest.append((name, tensor))
            if "transfer_codes" not in own:
                raise ValueError("a DSpine draft for SGLang needs transfer_codes: export it "
                                 "with `dspine export --format dflash-hf`")
            params = dict(self.named_parameters()) | dict(self.named_buffers())
            for name, tensor in own.items():
                if name in params:
                    params[name].data.copy_(tensor.to(params[name].dtype))
            return super().load_weights(rest)

    DSpineDraftModel.__name__ = ARCHITECTURE
    return DSpineDraftModel


def main(argv=None) -> None:
    """Register, then run SGLang's launch_server with the remaining arguments."""
    import runpy
    import sys

    register()
    sys.argv = ["sglang.launch_server", *(sys.argv[1:] if argv is None else argv)]
    runpy.run_module("sglang.launch_server", run_name="__main__")


# Under spawn, SGLang's scheduler processes re-import the launching module: register there.
if __name__ in ("__main__", "__mp_main__"):
    register()
if __name__ == "__main__":
    main()
