"""`dspine`: the command-line door to every job."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

import typer

import jax.numpy as jnp

from dspine_jax import cli_options as options
from dspine_jax.compile_cache import use_compile_cache
from dspine_jax.errors import ConfigError, DSpineError, InputError
from dspine_jax.registry import DEFAULT_TARGET

# Click's plain help, not typer's rich panels: those print `<bool>` after every switch (so
# users type `--chat true`, which fails) and cut long defaults with "..." at 80 columns.
# Click wraps instead of cutting, and uses up to 120 columns where the terminal has them.
HELP_SETTINGS = {"max_content_width": 120}
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  context_settings=HELP_SETTINGS,
                  help="DSpine-JAX: speculative decoding with DSpine and DFlash drafters.")




def _print_version(value: bool) -> None:
    if value:
        from dspine_jax import __version__

        typer.echo(f"dspine-jax {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_print_version,
                                       is_eager=True, help="Print the version and exit.")):
    pass


def _fail(error: Exception) -> None:
    typer.echo(f"error: {error}", err=True)
    raise typer.Exit(code=2)


@app.command(short_help="Generate text: AR, or speculative with a drafter.")
def generate(
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", metavar="TEXT",
                                         help="Prompt text."),
    prompts_file: Optional[Path] = typer.Option(
        None, "--prompts-file", metavar="FILE.jsonl",
        help='JSONL, one {"prompt": ..., "chat": true|false} per line.'),
    target: str = options.target(),
    method: Optional[str] = options.method(),
    drafter: Optional[str] = options.drafter(),
    chat: bool = typer.Option(False, "--chat", help="Apply the checkpoint's chat template."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", min=1, metavar="N"),
    temperature: float = options.temperature(),
    top_p: float = typer.Option(1.0, "--top-p", metavar="P"),
    top_k: int = typer.Option(0, "--top-k", metavar="K", help="0 disables."),
    seed: Optional[int] = options.seed(None),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Run to --max-new-tokens."),
    batch_size: int = options.batch_size(),
    dtype: str = options.dtype(),
    attention_backend: str = options.attention_backend(),
    proposal: str = options.proposal(),
    proposal_kernel: str = options.proposal_kernel(),
    speculation: Optional[str] = options.speculation(),
    max_verify_width: Optional[int] = options.max_verify_width(),
    passes_per_call: Optional[int] = options.passes_per_call(),
    compile_cache_dir: str = options.compile_cache_dir(),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per prompt on stdout."),
):
    """Generate text: autoregressive, or speculative with a DFlash or DSpine drafter."""
    try:
        from dspine_jax.api import Pipeline, Prompt
        from dspine_jax.runtime.requests import validate_sampling

        # Everything checkable is checked before Pipeline.load: loading takes seconds.
        validate_sampling(temperature, top_p, top_k)
        if (prompt is None) == (prompts_file is None):
            raise InputError("give exactly one of --prompt and --prompts-file")
        if prompt is not None and not prompt.strip():
            raise InputError("--prompt is empty; give the text to continue (or, with --chat, "
                             "the message to answer)")
        prompts = ([Prompt(prompt, chat)] if prompt is not None
                   else read_prompts_file(prompts_file, chat))
        use_compile_cache(compile_cache_dir)
        pipe = Pipeline.load(target, drafter, method=method, dtype=dtype,
                             steps_per_call=passes_per_call, attention_backend=attention_backend,
                             proposal=proposal, proposal_kernel=proposal_kernel,
                             speculation=options.speculation_config(speculation,
                                                                    max_verify_width))
        sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                        top_k=top_k, seed=seed, ignore_eos=ignore_eos)
        if as_json or len(prompts) > 1:
            results = pipe.generate(prompts, batch_size=batch_size, **sampling)
            for result in results:
                print(json.dumps({**result.to_json(pipe.method),
                                  "runtime": pipe.runtime.to_json(), "engine": result.engine})
                      if as_json else result.text)
            cut = [i for i, r in enumerate(results, 1) if r.finish_reason == "length"]
            if cut and not as_json:  # JSON carries finish_reason itself
                typer.echo(f"[{len(cut)} of {len(results)} prompts stopped at "
                           f"--max-new-tokens {max_new_tokens}: prompts "
                           f"{', '.join(map(str, cut))}]", err=True)
            return
        stream = pipe.stream(prompts[0], **sampling)
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
    typer.echo(summary_line(pipe.method, result, max_new_tokens), err=True)


def summary_line(method: str, result, max_new_tokens: int) -> str:
    """The stderr line after plain-text output: speed, acceptance, and whether the text
    ends because the budget ran out (plain text shows no finish_reason otherwise)."""
    rate = result.num_tokens / max(result.seconds, 1e-9)
    widths = ", ".join(f"{n} at width {w}" for w, n in result.verify_widths.items())
    accept = (f", mean acceptance length {result.mean_accept_length:.2f} (passes: "
              f"{widths or 'none'})" if method != "ar" else "")
    stopped = (f"; stopped at --max-new-tokens {max_new_tokens}"
               if result.finish_reason == "length" else "")
    return (f"[{method}: {result.num_tokens} tokens in {result.seconds:.2f}s, "
            f"{rate:.1f} tok/s{accept}, compile {result.compile_seconds:.1f}s{stopped}]")


def read_prompts_file(path: Path, default_chat: bool):
    from dspine_jax.api import Prompt
    from dspine_jax.data.prompts import jsonl_prompts

    records = jsonl_prompts(path, default_chat=default_chat)
    empty = [p["id"] for p in records if not p["prompt"].strip()]
    if empty:
        raise InputError(f"{path}: empty prompt (id or line {', '.join(empty[:5])})")
    return [Prompt(p["prompt"], p["chat"]) for p in records]


@app.command("eval", short_help="Acceptance length, tokens/s and speedup over AR.")
def evaluate_command(
    out: Path = typer.Option(..., "--out", metavar="DIR",
                             help="New folder for results.json, results.md and "
                                  "acceptance.png. A folder that already holds results is "
                                  "refused: pick a new one or delete the old results."),
    target: str = options.target(),
    drafter: list[str] = typer.Option([], "--drafter", metavar="NAME|PATH",
                                      help="Drafter name or folder (repeatable); each decodes "
                                      "with its own kind. AR always runs as the baseline."),
    benchmarks: str = typer.Option(
        "math500,aime24,aime25,humaneval,mtbench,sharegpt,cnmo", metavar="NAMES",
        show_default=False,  # spelled out below: a 54-character word wraps mid-name
        help="Comma-separated benchmark names; default: all of math500, aime24, aime25, "
             "humaneval, mtbench, sharegpt, cnmo."),
    temperature: float = options.temperature(),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1, metavar="N"),
    limit: Optional[int] = typer.Option(None, min=1, metavar="K",
                                        help="First K prompts per benchmark."),
    batch_size: int = options.batch_size(),
    max_prompt_tokens: Optional[int] = typer.Option(
        None, "--max-prompt-tokens", min=1, metavar="N",
        help="Skip (and count) longer prompts; default: whatever fits the context."),
    seed: int = options.seed(),
    dtype: str = options.dtype(),
    attention_backend: str = options.attention_backend(),
    proposal: str = options.proposal(),
    proposal_kernel: str = options.proposal_kernel(),
    speculation: Optional[str] = options.speculation(default="fixed"),
    max_verify_width: Optional[int] = options.max_verify_width(),
    compile_cache_dir: str = options.compile_cache_dir(),
):
    """Acceptance length, tokens/s and speedup over AR on the benchmark suite."""
    try:
        from dspine_jax.evaluation.benchmarks import BENCHMARKS
        from dspine_jax.evaluation.run import evaluate
        from dspine_jax.runtime.requests import validate_sampling

        validate_sampling(temperature, 1.0, 0)
        names = [b.strip() for b in benchmarks.split(",") if b.strip()]
        unknown = [b for b in names if b not in BENCHMARKS]
        if unknown:
            raise InputError(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)}")
        use_compile_cache(compile_cache_dir)
        evaluate(target, drafter, names, out, temperature=temperature,
                 max_new_tokens=max_new_tokens, limit=limit, batch_size=batch_size, seed=seed,
                 dtype=dtype, max_prompt_tokens=max_prompt_tokens,
                 attention_backend=attention_backend, proposal=proposal,
                 proposal_kernel=proposal_kernel,
                 speculation=options.speculation_config(speculation, max_verify_width,
                                                        default="fixed"))
    except DSpineError as e:
        _fail(e)
    typer.echo((out / "results.md").read_text())


@app.command()
def info(
    target: str = typer.Option(DEFAULT_TARGET, help="Built-in name or path."),
    speculation_costs: bool = typer.Option(
        False, "--speculation-costs",
        help="Instead: time each verify width of --drafter (default: the target's built-in "
             "DSpine drafter) at each --batch-size on this device, keep the times where "
             "adaptive speculation reads them, and print them with the width it would pick."),
    drafter: Optional[str] = options.drafter(),
    batch_size: list[int] = typer.Option([1, 8], "--batch-size", min=1, metavar="B",
                                         help="With --speculation-costs; repeatable."),
    acceptance: Optional[float] = typer.Option(
        None, "--acceptance", min=0.0, max=1.0, metavar="A",
        help="With --speculation-costs: the per-slot acceptance rate to pick widths for "
             "(default: the rate measured by earlier decoding, saved with the costs)."),
    dtype: str = options.dtype(),
):
    """Show a target's configuration and where its files are, and the built-in drafters;
    or, with --speculation-costs, the speculation cost table of this device."""
    try:
        from dspine_jax.checkpoints import load_target
        from dspine_jax.drafters.checkpoint import read_drafter_config
        from dspine_jax.registry import builtin_drafters

        if speculation_costs:
            print(json.dumps(speculation_cost_table(target, drafter, batch_size, acceptance,
                                                    dtype), indent=2))
            return
        loaded = load_target(target, dtype="f32")
        drafters = []
        for d in builtin_drafters():
            config = read_drafter_config(Path(d["folder"]))
            drafters.append({**d, "layers": config.num_hidden_layers,
                             "block_size": config.block_size})
    except DSpineError as e:
        _fail(e)
    print(json.dumps({"source": str(loaded.source), "num_params": loaded.config.num_params(),
                      **loaded.config.to_hf(), "built_in_drafters": drafters}, indent=2))


def speculation_cost_table(target: str, drafter: str | None, batch_sizes: list[int],
                           acceptance: float | None, dtype: str) -> dict:
    from dspine_jax.api import Pipeline
    from dspine_jax.speculative import costs
    from dspine_jax.speculative.policy import SpeculationConfig

    pipe = Pipeline.load(target, drafter, method=None if drafter else "dspine", dtype=dtype,
                         speculation=SpeculationConfig("adaptive"))
    costs.measure(pipe.decoder, batch_sizes)
    return {"target": target, "drafter": str(drafter or f"{target}-dspine"),
            **costs.report(pipe.decoder, batch_sizes, acceptance)}


@app.command("init-drafter", short_help="Write an untrained drafter for a target.")
def init_drafter(
    out: str = typer.Option(..., "--out", help="Folder to write (must not exist or be empty)."),
    target: str = options.target(),
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


@app.command(short_help="Export a drafter in the DFlash reference layout.")
def export(
    drafter: str = typer.Option(..., help="Built-in drafter name or checkpoint folder."),
    out: str = typer.Option(..., "--out", help="Folder to write (must not exist or be empty)."),
    format: str = typer.Option("dflash-hf", "--format", help="dflash-hf"),
    dtype: str = typer.Option("bf16", help="bf16 or f32 tensors."),
    target: str = typer.Option(DEFAULT_TARGET, help="The drafter's target: a DSpine "
                               "export includes the [V, r] code table built from its lm_head."),
    code_table: bool = typer.Option(True, "--code-table/--no-code-table",
                                    help="DSpine: the [V, r] code table in place of the "
                                    "whitening map (the reference layout, which "
                                    "SpecForge's DSpineDraftModel loads strictly); "
                                    "--no-code-table keeps the map (only this project's "
                                    "loaders read it)."),
):
    """Export a drafter in the layout the DFlash reference implementations read."""
    try:
        from dspine_jax.checkpoints import load_target, resolve_dtype
        from dspine_jax.drafters.checkpoint import load_drafter, save_drafter
        from dspine_jax.registry import resolve_drafter

        if format != "dflash-hf":
            raise InputError(f"unknown export format {format!r}; supported: dflash-hf")
        source = resolve_drafter(drafter)
        dest = _empty_folder(out)
        model = load_drafter(source, dtype=jnp.float32)
        model.config.check_reference_layout()
        table = None
        if model.config.dspine is not None and not code_table and model.has_code_table:
            raise InputError(f"{drafter} holds its transfer space as the code table only; "
                             "--no-code-table needs the whitening map")
        if model.config.dspine is not None and code_table:
            loaded = load_target(target, dtype="f32", with_tokenizer=False)  # lm_head only
            model.config.check_target(loaded.config)
            table = model.code_table(loaded.model.output_embedding())
        save_drafter(model, dest, dtype=resolve_dtype(dtype), code_table=table,
                     remote_code=True)
    except DSpineError as e:
        _fail(e)
    typer.echo(f"exported {model.config.kind} drafter to {dest} ({format}, {dtype})")


@app.command(short_help="Check the PyTorch port (dspine_torch) against JAX.")
def parity(
    target: str = typer.Option(..., "--target", metavar="NAME|PATH",
                               help="Built-in name, HF checkpoint folder or .gguf file."),
    drafter: str = typer.Option(..., "--drafter", metavar="NAME|PATH"),
    prompts: Optional[Path] = typer.Option(
        None, "--prompts", metavar="FILE.jsonl",
        help='One {"prompt": text} or {"token_ids": [...]} per line; default: 3 fixed.'),
    temperature: float = typer.Option(0.8, metavar="T", help="Temperature of the compared "
                                      "q distributions (tokens are compared at T = 0)."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", min=1, metavar="N"),
    dtype: str = typer.Option("f32", metavar="f32|bf16", help="bf16 also runs each side in "
                              "f32 and judges each stage against the two noise floors."),
):
    """Run the same prompts through JAX and PyTorch; report each stage's max difference
    and T = 0 token agreement. Exit 0 only when every stage is within tolerance."""
    try:
        from dspine_jax.parity import format_report, run_parity

        results, ok = run_parity(target, drafter, prompts_file=prompts,
                                 temperature=temperature, max_new_tokens=max_new_tokens,
                                 dtype=dtype)
    except DSpineError as e:
        _fail(e)
    typer.echo(format_report(results, ok))
    raise typer.Exit(code=0 if ok else 1)


data_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                       context_settings=HELP_SETTINGS, help="Training data jobs.")
app.add_typer(data_app, name="data")


@data_app.command("regenerate", short_help="The target's own responses: training data.")
def data_regenerate(
    out: Path = typer.Option(..., "--out", help="Dataset folder (resumed if it exists)."),
    target: str = options.target(),
    source: str = typer.Option("sharegpt", help="sharegpt (training split), "
                               "sharegpt:heldout, or a JSONL prompts file."),
    turns: str = typer.Option("first", help="ShareGPT: 'first' human turn of each "
                              "conversation, or 'all' human turns, each with the turns before "
                              "it as chat context (cut from the left by whole turns to fit)."),
    limit: Optional[int] = typer.Option(None, min=1, help="Use the first N prompts."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1),
    max_prompt_tokens: int = typer.Option(512, "--max-prompt-tokens", min=1,
                                          help="Longer prompts lose their earliest turns, or "
                                               "are skipped if their last turn is too long "
                                               "(both counted)."),
    temperatures: str = typer.Option("0", "--temperatures", metavar="T[,T...]",
                                     help="Answer every prompt at each of these "
                                          "temperatures, e.g. 0,0.7,1."),
    samples_per_prompt: int = typer.Option(1, "--samples-per-prompt", min=1,
                                           help="Responses per prompt at each T > 0 "
                                                "(T = 0 gives one)."),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: int = options.seed(),
    batch_size: int = typer.Option(32, "--batch-size", min=1, metavar="B",
                                   help="Slots: responses decoded at once."),
    shard_size: int = typer.Option(256, "--shard-size", min=1,
                                   help="Prompts per shard (with all their responses)."),
    dtype: str = options.dtype(),
    num_pages: Optional[int] = options.num_pages(
        "--batch-size x the pages of --max-prompt-tokens + --max-new-tokens, so no response "
        "is ever preempted. It changes the speed, not the data."),
    max_seconds: Optional[float] = typer.Option(
        None, "--max-seconds", min=0, metavar="S",
        help="Stop once a shard lands S seconds after the start (loading and compiling "
             "included); rerun the same command to continue."),
):
    """Regenerate responses with the target itself: the drafters' training data."""
    try:
        from dspine_jax.runtime.requests import validate_sampling
        from dspine_train.regenerate import regenerate

        try:
            temps = [float(t) for t in temperatures.split(",") if t.strip()]
        except ValueError:
            raise InputError(f"--temperatures expects numbers separated by commas, got "
                             f"{temperatures!r}") from None
        for t in temps:
            validate_sampling(t, top_p, 0)
        manifest = regenerate(out, target=target, source=source, turns=turns, limit=limit,
                              max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
                              temperatures=temps, samples_per_prompt=samples_per_prompt,
                              top_p=top_p, seed=seed, batch_size=batch_size,
                              shard_size=shard_size, dtype=dtype, num_pages=num_pages,
                              max_seconds=max_seconds)
    except DSpineError as e:
        _fail(e)
    shards = [s for s in manifest["shards"] if s["file"]]
    tokens = sum(s["response_tokens"] for s in shards)
    seconds = sum(s.get("seconds", 0) for s in shards)
    rate = f" ({tokens / seconds:,.0f} response tokens/s decoding)" if seconds else ""
    typer.echo(f"{out}: {sum(s['sequences'] for s in shards)} sequences, "
               f"{tokens} response tokens{rate} in {len(shards)} "
               f"{manifest['token_dtype']} shards; {manifest['skipped_long_prompts']} prompts "
               f"skipped as longer than {max_prompt_tokens} tokens, "
               f"{manifest['truncated_prompts']} cut to fit "
               f"({manifest['dropped_context_turns']} context turns dropped)")
    if not manifest["complete"]:
        done = sum(s["prompts"] for s in manifest["shards"])
        typer.echo(f"stopped at --max-seconds after {done} prompts; rerun the same command "
                   f"to continue")


@data_app.command("features", short_help="Cache the target's features for a config.")
def data_features(
    config: Optional[Path] = typer.Option(None, "--config", help="The training config."),
    overrides: list[str] = typer.Option([], "--set", help="section.key=value (repeatable)."),
    batch_size: int = typer.Option(16, "--batch-size", min=1),
):
    """Cache the target's features for a training config (data.cached_features = true)."""
    try:
        from dspine_train.config import load_config
        from dspine_train.features import cache_features

        folder = cache_features(load_config(config, overrides), batch_size=batch_size)
    except DSpineError as e:
        _fail(e)
    typer.echo(f"cached target features in {folder}")


@app.command(short_help="Train a DFlash or DSpine drafter (resumes).")
def train(
    config: Optional[Path] = typer.Option(None, "--config", help="TOML config file."),
    overrides: list[str] = typer.Option([], "--set", help="section.key=value (repeatable)."),
    resume_from: Optional[Path] = typer.Option(
        None, "--resume-from", metavar="RUN_DIR",
        help="Continue another run folder's latest checkpoint (weights, optimizer, step, "
             "data position) in this run.out: the next link of a chain (run.resume_from)."),
    init_from: Optional[str] = typer.Option(
        None, "--init-from", metavar="DIR|NAME",
        help="Start from the weights alone of a run folder (its latest checkpoint), an "
             "exported drafter or a built-in drafter's name: fresh optimizer, step 0 "
             "(drafter.init_from)."),
    distributed: bool = typer.Option(False, "--distributed",
                                     help="Multi-process (TPU pod, multi-host, or one process "
                                          "per GPU): call jax.distributed.initialize() first."),
    coordinator: Optional[str] = typer.Option(
        None, "--coordinator", help="With --distributed: process 0's HOST:PORT (default: "
        "detected from the cluster environment, e.g. TPU pod, SLURM, Open MPI)."),
    num_processes: Optional[int] = typer.Option(None, "--num-processes", min=1),
    process_id: Optional[int] = typer.Option(None, "--process-id", min=0),
):
    """Train a DFlash or DSpine drafter (resumes from the run folder's last checkpoint)."""
    try:
        if distributed:
            import jax

            # CPU processes need a collectives backend of their own (GPUs use NCCL).
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(coordinator, num_processes, process_id)
        elif coordinator or num_processes or process_id is not None:
            raise ConfigError("--coordinator, --num-processes and --process-id need "
                              "--distributed")
        from dspine_train.config import load_config
        from dspine_train.trainer import train as run_training

        extra = ([f"run.resume_from={json.dumps(str(resume_from))}"] if resume_from else []) + \
            ([f"drafter.init_from={json.dumps(str(init_from))}"] if init_from else [])
        summary = run_training(load_config(config, [*overrides, *extra]))
    except DSpineError as e:
        _fail(e)
    status = "finished" if summary["finished"] else "stopped"
    typer.echo(f"{status} at step {summary['steps']}; run folder {summary['out']}"
               + (f"; drafter exported to {summary['drafter']}" if "drafter" in summary else ""))


@app.command("serve", short_help="OpenAI-compatible HTTP server (completions, chat).")
def serve_command(
    target: str = options.target(),
    method: Optional[str] = options.method(),
    drafter: Optional[str] = options.drafter(),
    max_slots: int = typer.Option(8, "--max-slots", min=1, metavar="N",
                                  help="Requests decoded together (the rows of one batch)."),
    max_model_len: Optional[int] = typer.Option(
        None, "--max-model-len", min=2, metavar="N",
        help="Prompt + output positions per request; default: the model's context or "
             "2048, whichever is less."),
    num_pages: Optional[int] = options.num_pages(
        "--max-slots x the pages of --max-model-len, so every slot can hold a full-length "
        "request."),
    prefill_chunk: int = typer.Option(
        512, "--prefill-chunk", min=1, metavar="N",
        help="Prompt tokens prefilled per engine step and request: longer prompts take "
             "several steps while the running requests keep decoding."),
    max_queue: int = typer.Option(256, "--max-queue", min=0, metavar="N",
                                  help="Requests waiting for a slot; more get HTTP 429."),
    host: str = typer.Option("127.0.0.1", metavar="HOST",
                             help="Address to bind (0.0.0.0 exposes the server to the "
                                  "network: give it an --api-key)."),
    port: int = typer.Option(8000, min=0, max=65535, metavar="P"),
    served_model_name: Optional[str] = typer.Option(
        None, "--served-model-name", metavar="NAME",
        help="The model id clients send; default: --target as given."),
    grace_seconds: float = typer.Option(30.0, "--grace-seconds", min=0, metavar="S",
                                        help="On SIGTERM, how long requests in flight may "
                                             "run before they are cancelled."),
    dtype: str = options.dtype(),
    attention_backend: str = options.attention_backend(),
    proposal: str = options.proposal(),
    proposal_kernel: str = options.proposal_kernel(),
    speculation: Optional[str] = options.speculation(),
    max_verify_width: Optional[int] = options.max_verify_width(),
    passes_per_call: Optional[int] = options.passes_per_call(),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", envvar="DSPINE_API_KEY", metavar="KEY", show_default=False,
        help="Require 'Authorization: Bearer KEY' on every route but /health (401 "
             "otherwise). Default: $DSPINE_API_KEY, else none."),
    compile_cache_dir: str = options.compile_cache_dir(),
):
    """Serve /v1/completions and /v1/chat/completions (streaming too), /v1/models, /health
    and /metrics over one target, decoded AR or speculatively."""
    try:
        from dspine_jax.api import Pipeline, load_target
        from dspine_jax.runtime.config import EngineConfig

        try:
            from dspine_serve.server import bind, is_loopback, run
        except ImportError as e:
            raise ConfigError(f"serving needs the serve extra: pip install 'dspine-jax[serve]' "
                              f"({e})") from e

        if api_key is not None and not api_key.strip():
            raise InputError("--api-key is empty; give a key, or leave the option out")
        choice, speculation_config = Pipeline.check(
            target, drafter, method=method, dtype=dtype, attention_backend=attention_backend,
            proposal=proposal, proposal_kernel=proposal_kernel,
            speculation=options.speculation_config(speculation, max_verify_width))
        engine = EngineConfig(max_slots=max_slots, max_model_len=max_model_len,
                              num_pages=num_pages, prefill_chunk=prefill_chunk)
        sock = bind(host, port)       # a busy port fails now, not after the compiling
        if not api_key and not is_loopback(host):
            typer.echo(f"warning: serving on {host} without --api-key: anyone who reaches "
                       f"port {port} can use the model", err=True)
        use_compile_cache(compile_cache_dir)
        pipe = Pipeline.from_choice(load_target(target, dtype=dtype), choice, passes_per_call,
                                    serving=True,
                                    attention_backend=attention_backend, proposal=proposal,
                                    proposal_kernel=proposal_kernel,
                                    speculation=speculation_config)
        context = pipe.target.config.max_position_embeddings
        if max_model_len is not None and max_model_len > context:
            raise InputError(f"--max-model-len {max_model_len} is past the model's context "
                             f"of {context}")
        engine = dataclasses.replace(engine, max_model_len=max_model_len or min(context, 2048))
        run(pipe, engine, model_name=served_model_name or target, sock=sock,
            max_queue=max_queue, grace_seconds=grace_seconds, api_key=api_key)
    except DSpineError as e:
        _fail(e)


bench_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                        context_settings=HELP_SETTINGS, help="Benchmarks of running services.")
app.add_typer(bench_app, name="bench")


@bench_app.command("serve", short_help="Load-test a running server (bench_serving-style).",
                   context_settings={"allow_extra_args": True, **HELP_SETTINGS})
def bench_serve_command(
    ctx: typer.Context,
    base_url: str = typer.Option(..., "--base-url", metavar="URL",
                                 help="The server, e.g. http://127.0.0.1:8000 (loopback "
                                      "only)."),
    prompts: str = typer.Option("sharegpt:heldout", metavar="sharegpt:heldout|FILE.jsonl",
                                help='Prompt source; JSONL lines are {"prompt": ..., "chat": '
                                     "true|false}."),
    num_prompts: int = typer.Option(64, "--num-prompts", min=1, metavar="N",
                                    help="Requests per concurrency level."),
    concurrency: list[int] = typer.Option(
        [1, 8, 32, 64], "--concurrency", metavar="C [C ...]",
        help="Concurrency levels: --concurrency 1 8 32 64."),
    request_rate: float = typer.Option(float("inf"), "--request-rate", metavar="R",
                                       help="Poisson arrivals per second; inf sends all at "
                                            "once."),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1, metavar="N"),
    temperature: float = typer.Option(0.0, metavar="T"),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--stop-at-eos",
                                    help="Fixed output lengths (bench_serving's default)."),
    timeout: float = typer.Option(600.0, "--timeout", min=1, metavar="S",
                                  help="Per-request time limit."),
    duration: Optional[float] = typer.Option(
        None, "--duration", metavar="S",
        help="Soak: at each level keep sending (the prompts cycled) for S seconds, then "
             "wait for the requests in flight."),
    out: Optional[Path] = typer.Option(None, "--out", metavar="DIR",
                                       help="Folder for results.json and results.png."),
):
    """Streaming requests at each concurrency level: output tokens/s, request throughput,
    TTFT and inter-token latency p50/p99, acceptance length, failed requests."""
    try:
        from dspine_serve.bench import bench_serve

        levels = list(concurrency)
        if ctx.args and ctx.get_parameter_source("concurrency").name == "DEFAULT":
            raise InputError(f"unexpected argument(s) {' '.join(ctx.args)}")
        for extra in ctx.args:  # `--concurrency 1 8 32`: click hands over 8 and 32 here
            if not extra.isdigit() or int(extra) < 1:
                raise InputError(f"unexpected argument {extra!r}")
            levels.append(int(extra))
        result = bench_serve(base_url, prompts=prompts, num_prompts=num_prompts,
                             concurrency=levels, request_rate=request_rate,
                             max_tokens=max_tokens, temperature=temperature,
                             ignore_eos=ignore_eos, out=out, timeout=timeout,
                             duration=duration, log=lambda line: typer.echo(line, err=True))
    except DSpineError as e:
        _fail(e)
    print(json.dumps(result["levels"], indent=2, default=str))
    if out is not None:
        typer.echo(f"wrote {out / 'results.json'} and {out / 'results.png'}", err=True)


def _empty_folder(path: str):
    """Refuse to write over anything: nothing already written is lost."""
    from pathlib import Path

    dest = Path(path)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise InputError(f"{dest} already exists and is not empty; choose another --out")
    return dest


def main(argv: Optional[list[str]] = None) -> None:
    app(argv)
