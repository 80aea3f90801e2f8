"""A small Python API for notebooks, the CLI and the server: load, generate, stream.

    from dspine_jax.api import Pipeline
    pipe = Pipeline.load("smollm2-135m-instruct", drafter="smollm2-135m-instruct-dspine")
    [result] = pipe.generate(["What is 2+2?"], chat=True, max_new_tokens=64)
    print(result.text, result.mean_accept_length)
    for piece in pipe.stream("Tell me a story.", chat=True):
        print(piece, end="")
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator, Sequence

from dspine_jax.checkpoints import LoadedTarget, load_target, resolve_dtype
from dspine_jax.decoding import BatchDecoder, BatchResult, Generation, mean_accept_length
from dspine_jax.drafters import (DEFAULT_PROPOSAL, DEFAULT_PROPOSAL_KERNEL, PROPOSAL_KERNELS,
                                 PROPOSALS)
from dspine_jax.errors import CheckpointError, ConfigError, InputError
from dspine_jax.registry import BUILTIN_DRAFTERS, DEFAULT_TARGET, resolve_drafter
from dspine_jax.runtime.config import RuntimeConfig
from dspine_jax.runtime.offline import generate_tokens, stream_tokens
from dspine_jax.runtime.requests import validate_sampling
from dspine_jax.speculative.policy import SpeculationConfig

METHODS = ("ar", "dflash", "dspine")

# Target passes per device call. Long calls pay the per-call host cost less often: on an
# H200 at batch 1 the slot engine decodes AR at 892 tok/s with 4 passes per call and 989
# with 16, DSpine at 1,345 and 1,818 (docs/benchmarks.md). So every engine runs 16 while
# one row decodes alone; `dspine serve` (a `serving` pipeline) shortens its
# calls while several rows decode, because a row that finishes mid-call holds its slot and
# a waiting request waits until the call ends (served at concurrency 8, 4 passes per call
# gave DSpine 4,143 tok/s against 3,473 with 16).
OFFLINE_STEPS_PER_CALL = 16
SERVING_STEPS_PER_CALL = {"ar": 8, "drafter": 4}


def steps_per_call_for(method: str, serving: bool, given: int | None = None
                       ) -> tuple[int, int]:
    """(passes per call at most, passes per call while several rows share the slot
    engine's calls): `given` for both, else the defaults above."""
    if given is not None:
        return given, given
    shared = SERVING_STEPS_PER_CALL["ar" if method == "ar" else "drafter"]
    return OFFLINE_STEPS_PER_CALL, shared if serving else OFFLINE_STEPS_PER_CALL


@dataclasses.dataclass(frozen=True)
class MethodChoice:
    """How to decode, settled before any model is loaded."""
    method: str                 # ar, dflash or dspine
    drafter: Path | None        # a checked drafter folder; None for AR


def resolve_method(target: str | Path | None, drafter: str | Path | None,
                   method: str | None) -> MethodChoice:
    """The decoding method is whatever the drafter is: no drafter and no method is AR; a
    drafter alone decodes with its own kind (from its config.json); a method alone uses the
    target's built-in drafter of that kind. Reads only the drafter's config.json, so a bad
    request fails in milliseconds instead of after the target's load."""
    from dspine_jax.drafters.checkpoint import read_drafter_config

    if method is not None and method not in METHODS:
        raise InputError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    if drafter is None:
        if method in (None, "ar"):
            return MethodChoice("ar", None)
        builtin = f"{target}-{method}"
        if target is None or builtin not in BUILTIN_DRAFTERS:
            raise InputError(f"--method {method} needs --drafter" + (
                "" if target is None else f": target {target} has no built-in {method} "
                f"drafter (built-in drafters: {', '.join(BUILTIN_DRAFTERS)})"))
        drafter = builtin
    elif method == "ar":
        raise InputError(f"--method ar decodes without a drafter, but --drafter {drafter} was "
                         "given; drop --drafter, or drop --method to decode with the drafter")
    folder = resolve_drafter(str(drafter))
    if not folder.is_dir():
        raise CheckpointError(f"drafter {str(drafter)!r} is a file, not a checkpoint folder "
                              "(config.json + model.safetensors)")
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"drafter {str(drafter)!r}: {folder} has no config.json (not a "
                              "drafter checkpoint folder)")
    if not any((folder / name).is_file()
               for name in ("model.safetensors", "model.safetensors.index.json")):
        raise CheckpointError(f"drafter {str(drafter)!r}: {folder} has no model.safetensors")
    kind = read_drafter_config(folder).kind
    if method is not None and method != kind:
        raise ConfigError(f"--method {method} but the drafter at {drafter} is a {kind} "
                          f"drafter; drop --method or pass --method {kind}")
    return MethodChoice(kind, folder)


def check_attention_backend(name: str) -> None:
    from dspine_jax.attention import BACKENDS

    if name not in BACKENDS:
        raise InputError(f"attention backend must be one of {', '.join(BACKENDS)}; "
                         f"got {name!r}")


def check_proposal(proposal: str, proposal_kernel: str, method: str | None = None) -> None:
    """The proposal path (`proposal`, `proposal_kernel`) is a known one and has something to
    apply to: a drafter (not `method` "ar"), and a kernel only on the sparse path. Runs
    before anything loads."""
    for option, value, allowed in (("proposal", proposal, PROPOSALS),
                                   ("proposal-kernel", proposal_kernel, PROPOSAL_KERNELS)):
        if value not in allowed:
            raise InputError(f"--{option} must be one of {', '.join(allowed)}; got {value!r}")
    given = [f"--{option} {value}" for option, value, default in (
        ("proposal", proposal, DEFAULT_PROPOSAL),
        ("proposal-kernel", proposal_kernel, DEFAULT_PROPOSAL_KERNEL)) if value != default]
    if method == "ar" and given:
        raise InputError(f"{' and '.join(given)}: how a drafter proposes, but the method is ar "
                         "(no drafter); drop it, or decode with a drafter (--drafter)")
    if proposal == "dense" and proposal_kernel != DEFAULT_PROPOSAL_KERNEL:
        raise InputError(f"--proposal-kernel {proposal_kernel} is the kernel of the sparse "
                         "proposal; --proposal dense has none: drop one of the two")


def check_speculation(speculation: SpeculationConfig | None,
                      choice: MethodChoice | None = None) -> SpeculationConfig:
    """The speculation settings are valid and have a drafter to apply to; a width past the
    drafter's block is refused from its config.json, before anything loads. None: the
    default (adaptive). -> the settings to use."""
    if speculation is None:
        speculation = SpeculationConfig()
    elif choice is not None and choice.method == "ar":
        raise InputError("--speculation and --max-verify-width set how many drafted tokens "
                         "each pass verifies, but the method is ar (no drafter); drop them, "
                         "or decode with a drafter (--drafter)")
    speculation.validate()
    if choice is not None and choice.drafter is not None:
        from dspine_jax.drafters.checkpoint import read_drafter_config

        speculation.validate(read_drafter_config(choice.drafter).block_size)
    return speculation


@dataclasses.dataclass
class Prompt:
    text: str
    chat: bool = False


@dataclasses.dataclass
class Result:
    text: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str
    accept_lengths: list[int]
    seconds: float           # the run's decoding wall time (all its prompts)
    compile_seconds: float
    batch_size: int          # slots: prompts decoded at once
    verify_widths: dict[int, int] = dataclasses.field(default_factory=dict)  # width: passes
    engine: dict = dataclasses.field(default_factory=dict)   # the engine's EngineConfig

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def mean_accept_length(self) -> float:
        return mean_accept_length(self.accept_lengths)  # 0.0 with no pass: see there

    def to_json(self, method: str) -> dict:
        return {"text": self.text, "tokens": self.tokens, "num_tokens": self.num_tokens,
                "prompt_tokens": self.prompt_tokens, "finish_reason": self.finish_reason,
                "method": method, "mean_accept_length": round(self.mean_accept_length, 4),
                "accept_lengths": self.accept_lengths, "seconds": round(self.seconds, 4),
                "tokens_per_second": round(self.num_tokens / max(self.seconds, 1e-9), 2),
                "batch_size": self.batch_size,
                "verify_widths": {str(w): n for w, n in self.verify_widths.items()},
                "compile_seconds": round(self.compile_seconds, 2)}


def as_prompts(prompts: Sequence[Prompt | str], chat: bool | None = None) -> list[Prompt]:
    """Prompts as `Prompt`s; `chat` overrides every prompt's own flag when given."""
    return [Prompt(p, bool(chat)) if isinstance(p, str) else
            (dataclasses.replace(p, chat=chat) if chat is not None else p) for p in prompts]


class Pipeline:
    def __init__(self, target: LoadedTarget, decoder: BatchDecoder, method: str):
        self.target, self.decoder, self.method = target, decoder, method
        self.runtime = RuntimeConfig.of(decoder)      # what runs, for --json and /health
        self.tokenizer = target.tokenizer

    @classmethod
    def load(cls, target: str | Path = DEFAULT_TARGET, drafter: str | Path | None = None, *,
             method: str | None = None, dtype: str = "auto",
             steps_per_call: int | None = None, serving: bool = False,
             attention_backend: str = "auto", proposal: str = DEFAULT_PROPOSAL,
             proposal_kernel: str = DEFAULT_PROPOSAL_KERNEL,
             speculation: SpeculationConfig | None = None) -> "Pipeline":
        """`method` defaults to whatever `drafter` is (see `resolve_method`);
        `steps_per_call` (target passes per device call) defaults to 16, and with `serving`
        (a pipeline for the slot engine) to 8 for AR and 4 with a drafter while several
        rows decode (`steps_per_call_for`); given, it holds for every call;
        `attention_backend` is auto (pallas on GPU/TPU, else xla), pallas or xla.
        With a drafter, `proposal` is sparse (q and p only where verification needs them)
        or dense (for comparison), and `proposal_kernel` is the top-k over the vocabulary
        of DSpine's sparse proposal: xla, pallas or auto (pallas on GPU/TPU, else xla).
        `speculation` sets how many drafts each pass verifies (`SpeculationConfig`; default
        adaptive: the width per call from measured costs and acceptance).
        Every argument is checked before the target loads, so a typo costs no load time."""
        choice, speculation = cls.check(target, drafter, method=method, dtype=dtype,
                                        attention_backend=attention_backend,
                                        proposal=proposal, proposal_kernel=proposal_kernel,
                                        speculation=speculation)
        return cls.from_choice(load_target(target, dtype=dtype), choice, steps_per_call,
                               serving=serving, attention_backend=attention_backend,
                               proposal=proposal, proposal_kernel=proposal_kernel,
                               speculation=speculation)

    @staticmethod
    def check(target: str | Path = DEFAULT_TARGET, drafter: str | Path | None = None, *,
              method: str | None = None, dtype: str = "auto", attention_backend: str = "auto",
              proposal: str = DEFAULT_PROPOSAL, proposal_kernel: str = DEFAULT_PROPOSAL_KERNEL,
              speculation: SpeculationConfig | None = None
              ) -> tuple[MethodChoice, SpeculationConfig]:
        """`load`'s checks alone (milliseconds: a drafter's config.json at most) ->
        (the method choice, the speculation settings) for `from_choice`."""
        resolve_dtype(dtype)
        check_attention_backend(attention_backend)
        check_proposal(proposal, proposal_kernel)
        choice = resolve_method(target, drafter, method)
        check_proposal(proposal, proposal_kernel, choice.method)
        return choice, check_speculation(speculation, choice)

    @classmethod
    def from_loaded(cls, loaded: LoadedTarget, drafter: str | Path | None = None, *,
                    method: str | None = None, steps_per_call: int | None = None,
                    serving: bool = False, attention_backend: str = "auto",
                    proposal: str = DEFAULT_PROPOSAL,
                    proposal_kernel: str = DEFAULT_PROPOSAL_KERNEL,
                    speculation: SpeculationConfig | None = None) -> "Pipeline":
        """A pipeline over an already loaded target (several drafters share one target);
        the options as in `load`."""
        check_proposal(proposal, proposal_kernel)
        # A loaded target has a path, not a name: it has no built-in drafter to default to.
        choice = resolve_method(None, drafter, method)
        check_proposal(proposal, proposal_kernel, choice.method)
        speculation = check_speculation(speculation, choice)
        return cls.from_choice(loaded, choice, steps_per_call, serving=serving,
                               attention_backend=attention_backend, proposal=proposal,
                               proposal_kernel=proposal_kernel, speculation=speculation)

    @classmethod
    def from_choice(cls, loaded: LoadedTarget, choice: MethodChoice,
                    steps_per_call: int | None = None, *, serving: bool = False,
                    attention_backend: str = "auto", proposal: str = DEFAULT_PROPOSAL,
                    proposal_kernel: str = DEFAULT_PROPOSAL_KERNEL,
                    speculation: SpeculationConfig | None = None) -> "Pipeline":
        """A pipeline for a `resolve_method` result (checked before the target loaded);
        `proposal`, `proposal_kernel` and `speculation` as in `load`, unused by AR."""
        from dspine_jax.drafters.checkpoint import load_drafter
        from dspine_jax.engine import SpeculativeEngine
        from dspine_jax.generate import AutoregressiveGenerator

        eos = loaded.tokenizer.eos_token_ids if loaded.tokenizer is not None else ()
        steps_per_call, shared = steps_per_call_for(choice.method, serving, steps_per_call)
        if choice.drafter is None:
            decoder = AutoregressiveGenerator(loaded.model, eos_token_ids=eos,
                                              steps_per_call=steps_per_call,
                                              shared_steps_per_call=shared,
                                              attention_backend=attention_backend)
            return cls(loaded, decoder, "ar")
        model = load_drafter(choice.drafter, dtype=loaded.model.dtype)
        decoder = SpeculativeEngine(loaded.model, model, eos_token_ids=eos,
                                    steps_per_call=steps_per_call,
                                    shared_steps_per_call=shared,
                                    attention_backend=attention_backend,
                                    proposal_impl=proposal, proposal_kernel=proposal_kernel,
                                    speculation=speculation or SpeculationConfig())
        return cls(loaded, decoder, choice.method)

    def encode(self, prompt: Prompt | str) -> list[int]:
        prompt = prompt if isinstance(prompt, Prompt) else Prompt(prompt)
        if prompt.chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt.text}])
        return self.tokenizer.encode(prompt.text)

    def generate(self, prompts: Sequence[Prompt | str], *, chat: bool | None = None,
                 max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, ignore_eos: bool = False,
                 batch_size: int = 8) -> list[Result]:
        """Decode prompts through `batch_size` slots of continuous batching (a finished
        response's slot takes the next prompt at once); results keep the input order and
        `seconds` is the whole run's. With a seed, prompt i samples from seed + i
        (reproducible, at the whole block's width); without, from a fresh seed. `chat`
        overrides every prompt's own flag when given."""
        validate_sampling(temperature, top_p, top_k)
        prompts = as_prompts(prompts, chat)
        batch = generate_tokens(self.decoder, [self.encode(p) for p in prompts],
                                max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k, seed=seed, ignore_eos=ignore_eos,
                                max_slots=batch_size)
        return [self._result(g, batch, batch_size) for g in batch.generations]

    def stream(self, prompt: Prompt | str, *, chat: bool = False, **options) -> Iterator[str]:
        """Yield text as it is decoded (incomplete UTF-8 is held back); returns the Result."""
        prompt = prompt if isinstance(prompt, Prompt) else Prompt(prompt, chat)
        validate_sampling(options.get("temperature", 0.0), options.get("top_p", 1.0),
                          options.get("top_k", 0))
        ids, printed = [], 0
        events = stream_tokens(self.decoder, [self.encode(prompt)], **options)
        while True:
            try:
                _, new = next(events)
            except StopIteration as finished:
                batch = finished.value
                break
            ids.extend(new)
            text = self.tokenizer.decode(ids)
            if not text.endswith("\ufffd"):
                yield text[printed:]
                printed = len(text)
        text = self.tokenizer.decode(ids)
        if len(text) > printed:
            yield text[printed:]
        return self._result(batch.generations[0], batch, 1)

    def _result(self, g: Generation, batch: BatchResult, batch_size: int) -> Result:
        return Result(text=self.tokenizer.decode(g.tokens), tokens=g.tokens,
                      prompt_tokens=g.prompt_tokens, finish_reason=g.finish_reason,
                      accept_lengths=g.accept_lengths, seconds=batch.seconds,
                      compile_seconds=batch.compile_seconds, batch_size=batch_size,
                      verify_widths=g.verify_widths, engine=batch.engine)
