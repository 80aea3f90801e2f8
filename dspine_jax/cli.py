"""`dspine`: the command-line door to every job."""

from __future__ import annotations

import json
import sys
from pathlib import Path
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
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text."),
    prompts_file: Optional[Path] = typer.Option(
        None, "--prompts-file", help='JSONL, one {"prompt": ..., "chat": true|false} per line.'),
    target: str = typer.Option(DEFAULT_TARGET, help="Built-in name, HF folder or .gguf file."),
    method: str = typer.Option("ar", help="ar, dflash or dspine."),
    drafter: Optional[str] = typer.Option(
        None, help="Drafter name or folder (default: the built-in one for the target)."),
    chat: bool = typer.Option(False, "--chat", help="Apply the checkpoint's chat template."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", min=1),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 disables."),
    seed: int = typer.Option(0),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Run to max-new-tokens."),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Prompts decoded together."),
    dtype: str = typer.Option("auto", help="auto, bf16 or f32."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per prompt on stdout."),
):
    """Generate text: autoregressive, or speculative with a DFlash or DSpine drafter."""
    try:
        from dspine_jax.api import Pipeline, Prompt
        from dspine_jax.sampling import validate_sampling

        validate_sampling(temperature, top_p, top_k)
        if (prompt is None) == (prompts_file is None):
            raise InputError("give exactly one of --prompt and --prompts-file")
        prompts = ([Prompt(prompt, chat)] if prompt is not None
                   else read_prompts_file(prompts_file, chat))
        pipe = Pipeline.load(target, drafter, method=method, dtype=dtype)
        options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                       top_k=top_k, seed=seed, ignore_eos=ignore_eos)
        if as_json or len(prompts) > 1:
            for result in pipe.generate(prompts, batch_size=batch_size, **options):
                print(json.dumps(result.to_json(pipe.method)) if as_json else result.text)
            return
        stream = pipe.stream(prompts[0], **options)
        while True:
            try:
                sys.stdout.write(next(stream))
                sys.stdout.flush()
            except StopIteration as finished:
                result = finished.value
                break
    except DSpineError as e:
        _fail(e)
    print()
    rate = result.num_tokens / max(result.seconds, 1e-9)
    accept = (f", mean acceptance length {result.mean_accept_length:.2f}"
              if pipe.method != "ar" else "")
    typer.echo(f"[{pipe.method}: {result.num_tokens} tokens in {result.seconds:.2f}s, "
               f"{rate:.1f} tok/s{accept}, compile {result.compile_seconds:.1f}s]", err=True)


def read_prompts_file(path: Path, default_chat: bool):
    """JSONL prompts; a malformed line is an error naming its number."""
    from dspine_jax.api import Prompt

    if not path.is_file():
        raise InputError(f"{path}: no such prompts file")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{number}: not valid JSON ({e.msg})") from e
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise InputError(f'{path}:{number}: expected an object with a string "prompt"')
        chat = record.get("chat", default_chat)
        if not isinstance(chat, bool):
            raise InputError(f'{path}:{number}: "chat" must be true or false')
        prompts.append(Prompt(record["prompt"], chat))
    if not prompts:
        raise InputError(f"{path}: no prompts")
    return prompts


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
