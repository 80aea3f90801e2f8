"""`dspine`: the command-line door to every job."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

import jax.numpy as jnp

from dspine_jax.errors import DSpineError, InputError
from dspine_jax.registry import DEFAULT_TARGET

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="DSpine-JAX: speculative decoding with DSpine and DFlash drafters.")


def _fail(error: Exception) -> None:
    typer.echo(f"error: {error}", err=True)
    raise typer.Exit(code=2)


@app.command()
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text."),
    target: str = typer.Option(DEFAULT_TARGET, help="Built-in name, HF folder or .gguf file."),
    chat: bool = typer.Option(False, "--chat", help="Apply the checkpoint's chat template."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", min=1),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 disables."),
    seed: int = typer.Option(0),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Run to max-new-tokens."),
    dtype: str = typer.Option("auto", help="auto, bf16 or f32."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
):
    """Generate text from a prompt with the target model (autoregressive)."""
    try:
        from dspine_jax.checkpoints import load_target
        from dspine_jax.generate import AutoregressiveGenerator
        from dspine_jax.sampling import validate_sampling

        validate_sampling(temperature, top_p, top_k)
        loaded = load_target(target, dtype=dtype)
        tok = loaded.tokenizer
        ids = (tok.encode_chat([{"role": "user", "content": prompt}]) if chat
               else tok.encode(prompt))
        generator = AutoregressiveGenerator(loaded.model, eos_token_ids=tok.eos_token_ids)
        streamer = None if as_json else _Streamer(tok)
        result = generator.generate(
            [ids], max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=seed, ignore_eos=ignore_eos,
            on_tokens=None if streamer is None else streamer.push)
    except DSpineError as e:
        _fail(e)
    gen = result.generations[0]
    if as_json:
        print(json.dumps({
            "text": tok.decode(gen.tokens), "tokens": gen.tokens,
            "num_tokens": len(gen.tokens), "prompt_tokens": gen.prompt_tokens,
            "finish_reason": gen.finish_reason, "seconds": round(result.seconds, 4),
            "tokens_per_second": round(len(gen.tokens) / result.seconds, 2),
            "compile_seconds": round(result.compile_seconds, 2), "method": "ar",
            "target": str(loaded.source),
        }))
    else:
        streamer.close()
        typer.echo(f"[{len(gen.tokens)} tokens in {result.seconds:.2f}s, "
                   f"{len(gen.tokens) / result.seconds:.1f} tok/s, "
                   f"compile {result.compile_seconds:.1f}s]", err=True)


class _Streamer:
    """Prints decoded text as tokens arrive, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.printed = tokenizer, [], 0

    def push(self, row: int, ids: list[int]) -> None:
        self.ids.extend(ids)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return  # a multi-byte character is still incomplete
        sys.stdout.write(text[self.printed:])
        sys.stdout.flush()
        self.printed = len(text)

    def close(self) -> None:
        sys.stdout.write(self.tok.decode(self.ids)[self.printed:] + "\n")
        sys.stdout.flush()


@app.command()
def info(target: str = typer.Option(DEFAULT_TARGET, help="Built-in name or path.")):
    """Show a target's configuration and where its files are."""
    try:
        from dspine_jax.checkpoints import load_target

        loaded = load_target(target, dtype="f32")
    except DSpineError as e:
        _fail(e)
    print(json.dumps({"source": str(loaded.source), "num_params": loaded.config.num_params(),
                      **loaded.config.to_hf()}, indent=2))


@app.command("init-drafter")
def init_drafter(
    out: str = typer.Option(..., "--out", help="Folder to write (must not exist or be empty)."),
    target: str = typer.Option(DEFAULT_TARGET, help="Built-in name, HF folder or .gguf file."),
    kind: str = typer.Option("dspine", help="dflash or dspine."),
    layers: int = typer.Option(5, min=1, help="Draft layers."),
    block_size: int = typer.Option(16, min=2),
    mask_token_id: Optional[int] = typer.Option(None, help="Default: see mask_token_for()."),
    seed: int = typer.Option(0),
):
    """Write a freshly initialised (untrained) drafter for a target."""
    try:
        from dspine_jax.checkpoints import load_target
        from dspine_jax.drafters.checkpoint import save_drafter
        from dspine_jax.drafters.config import DrafterConfig, mask_token_for
        from dspine_jax.drafters.model import BlockDrafter

        dest = _empty_folder(out)
        loaded = load_target(target, dtype="f32")
        mask = mask_token_id if mask_token_id is not None else mask_token_for(loaded.tokenizer)
        config = DrafterConfig.for_target(loaded.config, kind=kind, num_layers=layers,
                                          mask_token_id=mask, block_size=block_size)
        drafter = BlockDrafter.create(config, loaded.model.output_embedding(), seed=seed)
        save_drafter(drafter, dest)
    except DSpineError as e:
        _fail(e)
    typer.echo(f"wrote an untrained {kind} drafter ({layers} layers, block {block_size}, "
               f"target layers {list(config.target_layer_ids)}, mask token {mask}) to {dest}")


@app.command()
def export(
    drafter: str = typer.Option(..., help="Built-in drafter name or checkpoint folder."),
    out: str = typer.Option(..., "--out", help="Folder to write (must not exist or be empty)."),
    format: str = typer.Option("dflash-hf", "--format", help="dflash-hf"),
    dtype: str = typer.Option("bf16", help="bf16 or f32 tensors."),
):
    """Export a drafter in the layout the DFlash reference implementations read."""
    try:
        from dspine_jax.checkpoints import resolve_dtype
        from dspine_jax.drafters.checkpoint import load_drafter, save_drafter
        from dspine_jax.registry import resolve_drafter

        if format != "dflash-hf":
            raise InputError(f"unknown export format {format!r}; supported: dflash-hf")
        source = resolve_drafter(drafter)
        dest = _empty_folder(out)
        model = load_drafter(source, dtype=jnp.float32)
        save_drafter(model, dest, dtype=resolve_dtype(dtype))
    except DSpineError as e:
        _fail(e)
    typer.echo(f"exported {model.config.kind} drafter to {dest} ({format}, {dtype})")


def _empty_folder(path: str):
    """Refuse to write over anything: nothing already written is lost."""
    from pathlib import Path

    dest = Path(path)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise InputError(f"{dest} already exists and is not empty; choose another --out")
    return dest


def main(argv: Optional[list[str]] = None) -> None:
    app(argv)
