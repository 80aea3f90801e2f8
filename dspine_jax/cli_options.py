"""Options that several `dspine` commands share, each defined once (flag, default, metavar,
help), so that `generate`, `eval` and `serve` cannot drift apart.

Each function returns a fresh typer option to use as a parameter's default:

    def generate(target: str = options.target(), dtype: str = options.dtype(), ...):
"""

from __future__ import annotations

import typer

from dspine_jax.drafters import (DEFAULT_PROPOSAL, DEFAULT_PROPOSAL_KERNEL, PROPOSAL_KERNELS,
                                 PROPOSALS)
from dspine_jax.registry import DEFAULT_TARGET


def target():
    return typer.Option(DEFAULT_TARGET, "--target", metavar="NAME|PATH",
                        help="Built-in name, HF folder or .gguf file.")


def method():
    return typer.Option(
        None, "--method", metavar="ar|dflash|dspine",
        help="Default: the drafter's kind with --drafter, else ar. Without --drafter, "
             "dflash or dspine use the target's built-in drafter of that kind.")


def drafter():
    return typer.Option(None, "--drafter", metavar="NAME|PATH",
                        help="Built-in drafter name or checkpoint folder; decodes "
                             "speculatively with it.")


def temperature():
    return typer.Option(0.0, "--temperature", metavar="T", help="0 is greedy.")


def seed(default: int | None = 0):
    """One definition for every command; only the default's sentence differs (generate:
    fresh seeds; eval and data regenerate: 0, so their figures and data reproduce)."""
    fresh = ("a fresh seed per prompt, so sampled rows take adaptive widths too"
             if default is None else str(default))
    return typer.Option(
        default, "--seed", metavar="S", show_default=False,
        help="Sampled text is reproducible from S (each prompt's seed is derived from it), "
             "at any batch size; with a drafter at T > 0 every pass then verifies the whole "
             f"block, the one width a seed reproduces at. Default: {fresh}.")


def batch_size():
    return typer.Option(8, "--batch-size", min=1, metavar="B",
                        help="Prompts decoded together: slots of continuous batching, a "
                             "finished response's slot taking the next prompt at once.")


def dtype():
    return typer.Option("auto", "--dtype", metavar="auto|bf16|f32")


def attention_backend():
    return typer.Option(
        "auto", "--attention-backend", metavar="auto|pallas|xla",
        help="auto: pallas (the paged-attention kernel) on GPU/TPU, xla elsewhere; pallas "
             "on the CPU runs the kernel in interpret mode (slow).")


def proposal():
    return typer.Option(
        DEFAULT_PROPOSAL, "--proposal", metavar="|".join(PROPOSALS),
        help="Speculative decoding only. sparse: q and p only where verification needs "
             "them; dense: q [K-1, V] and p [K, V] for every slot (for comparison).")


def proposal_kernel():
    return typer.Option(
        DEFAULT_PROPOSAL_KERNEL, "--proposal-kernel", metavar="|".join(PROPOSAL_KERNELS),
        help="DSpine's sparse proposal: the top-k over the vocabulary. xla: XLA's TopK over "
             "the full logits; pallas: the Pallas kernel (interpret mode on the CPU, slow); "
             "auto: pallas on GPU/TPU, xla elsewhere.")


def num_pages(default: str):
    """The slot engine's page pool; `default` says what it is when not given."""
    return typer.Option(
        None, "--num-pages", min=1, metavar="N",
        help="KV cache pages (16 positions each) shared by all slots; requests are admitted "
             "while their pages are free and the newest is preempted (recomputed later) "
             f"when they run out. Default: {default}")


def compile_cache_dir():
    return typer.Option(
        "default", "--compile-cache-dir", metavar="DIR|none",
        help="JAX's persistent compilation cache, so the next run of the same shapes "
             "loads its programs instead of compiling them. Default: jax-compile-cache in "
             "the cache folder (DSPINE_CACHE_DIR); none: off.")


def speculation(default: str = "adaptive"):
    return typer.Option(
        None, "--speculation", metavar="adaptive|fixed|off", show_default=False,
        help="Speculative decoding only: how many drafted tokens each pass verifies. "
             "adaptive: per call, the width (0, 1, 3, 7 or 15) with the most expected "
             "tokens/s from the costs and acceptance measured so far (kept per device in "
             "the cache folder; a sampled row with a seed, as every prompt has under "
             "--seed, runs the whole block so that its seed reproduces it); fixed: every "
             f"pass the whole block; off: plain AR steps. Default: {default}.")


def passes_per_call():
    return typer.Option(
        None, "--passes-per-call", min=1, max=64, metavar="N", show_default=False,
        help="Target passes per device call (a call stops early once all its rows are "
             "done). Longer calls pay the per-call host cost less often; shorter ones free "
             "a finished row's slot and admit new requests sooner. Default: 16; dspine "
             "serve, while several rows decode: 8 for AR and 4 with a drafter.")


def max_verify_width():
    return typer.Option(
        None, "--max-verify-width", metavar="K", show_default=False,
        help="Verify at most K drafts per pass (default: the drafter's block size - 1).")


def speculation_config(mode: str | None, max_verify_width: int | None,
                       default: str = "adaptive"):
    """The `SpeculationConfig` of the two flags (`default` the mode when only a width is
    given); None when neither was given: the command's default, and no complaint for AR."""
    from dspine_jax.speculative.policy import SpeculationConfig

    if mode is None and max_verify_width is None:
        return None
    config = SpeculationConfig(mode or default, max_verify_width)
    config.validate()
    return config
