"""A small Python API for notebooks, the CLI and the server: load, generate, stream.

    from dspine_jax.api import Pipeline
    pipe = Pipeline.load("smollm2-135m-instruct", drafter="path/to/drafter")
    [result] = pipe.generate(["What is 2+2?"], chat=True, max_new_tokens=64)
    print(result.text, result.mean_accept_length)
    for piece in pipe.stream("Tell me a story.", chat=True):
        print(piece, end="")
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator, Sequence

from dspine_jax.checkpoints import LoadedTarget, load_target
from dspine_jax.decoding import BatchDecoder
from dspine_jax.errors import ConfigError, InputError
from dspine_jax.registry import DEFAULT_TARGET, resolve_drafter
from dspine_jax.sampling import validate_sampling

METHODS = ("ar", "dflash", "dspine")


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
    seconds: float           # the batch's wall time (prefill + decode)
    compile_seconds: float
    batch_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def mean_accept_length(self) -> float:
        """Tokens emitted per target verify pass, bonus included (1.0 for AR)."""
        passes = self.accept_lengths
        return sum(passes) / len(passes) if passes else 1.0

    def to_json(self, method: str) -> dict:
        return {"text": self.text, "tokens": self.tokens, "num_tokens": self.num_tokens,
                "prompt_tokens": self.prompt_tokens, "finish_reason": self.finish_reason,
                "method": method, "mean_accept_length": round(self.mean_accept_length, 4),
                "accept_lengths": self.accept_lengths, "seconds": round(self.seconds, 4),
                "tokens_per_second": round(self.num_tokens / max(self.seconds, 1e-9), 2),
                "batch_size": self.batch_size,
                "compile_seconds": round(self.compile_seconds, 2)}


class Pipeline:
    def __init__(self, target: LoadedTarget, decoder: BatchDecoder, method: str):
        self.target, self.decoder, self.method = target, decoder, method
        self.tokenizer = target.tokenizer

    @classmethod
    def load(cls, target: str | Path = DEFAULT_TARGET, drafter: str | Path | None = None, *,
             method: str | None = None, dtype: str = "auto",
             steps_per_call: int | None = None) -> "Pipeline":
        loaded = load_target(target, dtype=dtype)
        if drafter is None and method not in (None, "ar") and isinstance(target, str):
            drafter = f"{target}-{method}"  # the built-in drafter for the target
        return cls.from_loaded(loaded, drafter, method=method, steps_per_call=steps_per_call)

    @classmethod
    def from_loaded(cls, loaded: LoadedTarget, drafter: str | Path | None = None, *,
                    method: str | None = None, steps_per_call: int | None = None) -> "Pipeline":
        """A pipeline over an already loaded target (several drafters share one target)."""
        from dspine_jax.drafters.checkpoint import load_drafter
        from dspine_jax.engine import SpeculativeEngine
        from dspine_jax.generate import AutoregressiveGenerator

        method = method or ("ar" if drafter is None else None)
        eos = loaded.tokenizer.eos_token_ids
        if method == "ar":
            decoder = AutoregressiveGenerator(loaded.model, eos_token_ids=eos,
                                              steps_per_call=steps_per_call or 8)
            return cls(loaded, decoder, "ar")
        if method is not None and method not in METHODS:
            raise InputError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
        if drafter is None:
            raise InputError(f"--method {method} needs --drafter")
        model = load_drafter(resolve_drafter(str(drafter)), dtype=loaded.model.dtype)
        if method is not None and model.config.kind != method:
            raise ConfigError(f"--method {method} but the drafter at {drafter} is a "
                              f"{model.config.kind} drafter")
        decoder = SpeculativeEngine(loaded.model, model, eos_token_ids=eos,
                                    steps_per_call=steps_per_call or 4)
        return cls(loaded, decoder, model.config.kind)

    def encode(self, prompt: Prompt | str) -> list[int]:
        prompt = prompt if isinstance(prompt, Prompt) else Prompt(prompt)
        if prompt.chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt.text}])
        return self.tokenizer.encode(prompt.text)

    def generate(self, prompts: Sequence[Prompt | str], *, chat: bool | None = None,
                 max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0, ignore_eos: bool = False,
                 batch_size: int = 8) -> list[Result]:
        """Decode prompts in batches of `batch_size`; results keep the input order.
        `chat` overrides every prompt's own flag when given."""
        validate_sampling(temperature, top_p, top_k)
        prompts = [Prompt(p, bool(chat)) if isinstance(p, str) else
                   (dataclasses.replace(p, chat=chat) if chat is not None else p) for p in prompts]
        results = []
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            batch = self.decoder.generate(
                [self.encode(p) for p in chunk], max_new_tokens=max_new_tokens,
                temperature=temperature, top_p=top_p, top_k=top_k, seed=seed + start,
                ignore_eos=ignore_eos)
            for g in batch.generations:
                results.append(Result(
                    text=self.tokenizer.decode(g.tokens), tokens=g.tokens,
                    prompt_tokens=g.prompt_tokens, finish_reason=g.finish_reason,
                    accept_lengths=g.accept_lengths, seconds=batch.seconds,
                    compile_seconds=batch.compile_seconds, batch_size=len(chunk)))
        return results

    def stream(self, prompt: Prompt | str, *, chat: bool = False, **options) -> Iterator[str]:
        """Yield text as it is decoded (incomplete UTF-8 is held back); returns the Result."""
        prompt = prompt if isinstance(prompt, Prompt) else Prompt(prompt, chat)
        validate_sampling(options.get("temperature", 0.0), options.get("top_p", 1.0),
                          options.get("top_k", 0))
        ids, printed = [], 0
        events = self.decoder.stream([self.encode(prompt)], **options)
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
        g = batch.generations[0]
        return Result(text=text, tokens=g.tokens, prompt_tokens=g.prompt_tokens,
                      finish_reason=g.finish_reason, accept_lengths=g.accept_lengths,
                      seconds=batch.seconds, compile_seconds=batch.compile_seconds,
                      batch_size=1)
