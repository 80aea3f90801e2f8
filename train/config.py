"""Training configuration: a TOML file plus `--set section.key=value` overrides.

Every field is typed; an unknown section or key, or a value of the wrong type, is an
error naming it. Defaults follow the paper (AdamW 6e-4, cosine, 4% warm-up, clip 1.0).
Two sections are the library's own declarations, not copies: `[dspine]` is
`DSpineConfig` (the architecture a drafter checkpoint stores) and `[loss]` is
`LossConfig` (loss terms and the teacher-replacement curriculum).
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path
from typing import Any

from dspine_jax.drafters.config import DSpineConfig
from dspine_jax.errors import ConfigError
from dspine_jax.losses import LossConfig


TRAINING_ATTENTION = ("auto", "xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class TargetSection:
    name: str = "smollm2-135m-instruct"
    dtype: str = "auto"                    # the frozen target's compute dtype
    attention: str = "auto"                # its attention in training: xla (everywhere),
                                           # cudnn (fused, never writes the scores; CUDA
                                           # GPUs, bf16/f16) or auto (cudnn where it runs)

    def __post_init__(self):
        if self.attention not in TRAINING_ATTENTION:
            raise ConfigError(f"target.attention must be one of {TRAINING_ATTENTION}, got "
                              f"{self.attention!r}")


@dataclasses.dataclass(frozen=True)
class DrafterSection:
    kind: str = "dspine"                   # dflash | dspine
    layers: int = 5
    block_size: int = 16
    mask_token_id: int = -1                # -1: the target tokenizer's mask token
    init_from: str = ""                    # weights only, fresh optimizer and step 0: a
                                           # drafter folder, or a run folder (its latest
                                           # checkpoint's weights); else a fresh drafter
    attention: str = "auto"                # its attention over context and blocks, as
                                           # target.attention (cudnn: the blocks' mask as
                                           # a bias; bf16/f16 run.compute_dtype)

    def __post_init__(self):
        if self.kind not in ("dflash", "dspine"):
            raise ConfigError(f"drafter.kind must be 'dflash' or 'dspine', got {self.kind!r}")
        if self.attention not in TRAINING_ATTENTION:
            raise ConfigError(f"drafter.attention must be one of {TRAINING_ATTENTION}, got "
                              f"{self.attention!r}")


@dataclasses.dataclass(frozen=True)
class DataSection:
    path: str = "runs/data"                # a `dspine data regenerate` folder
    seq_len: int = 512                     # longer sequences are cut (counted in the log)
    blocks_per_seq: int = 32               # anchors sampled per sequence, every step
    cached_features: bool = False          # read `dspine data features` output instead of
                                           # running the target inside the step


@dataclasses.dataclass(frozen=True)
class OptimSection:
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.95


@dataclasses.dataclass(frozen=True)
class RunSection:
    out: str = "runs/train"
    steps: int = 1000
    batch_size: int = 16                   # global, across all devices and hosts
    seed: int = 0
    compute_dtype: str = "bf16"            # drafter compute; master weights stay float32
    log_every: int = 10
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    stop_after: int = 0                    # >0: stop (as if killed) after this many steps
    max_seconds: float = 0                 # >0: checkpoint and stop after this long (resumable)
    resume_from: str = ""                  # a previous run folder: continue its latest
                                           # checkpoint (weights, optimizer, RNG, data
                                           # position, step) in this run.out


@dataclasses.dataclass(frozen=True)
class MeshSection:
    data: int = -1                         # -1: all devices not used by fsdp
    fsdp: int = 1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    target: TargetSection = TargetSection()
    drafter: DrafterSection = DrafterSection()
    dspine: DSpineConfig | None = None     # None: the width-dependent default (kind dspine)
    loss: LossConfig = LossConfig()
    data: DataSection = DataSection()
    optim: OptimSection = OptimSection()
    run: RunSection = RunSection()
    mesh: MeshSection = MeshSection()

    def __post_init__(self):
        if self.dspine is not None and self.drafter.kind != "dspine":
            raise ConfigError("a [dspine] section configures a DSpine drafter, but "
                              f"drafter.kind is {self.drafter.kind!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _section_class(hint):
    """The dataclass behind a section's type hint (`X | None` -> X)."""
    options = [a for a in typing.get_args(hint) if a is not type(None)]
    return options[0] if options else hint


def _coerce(where: str, value: Any, kind) -> Any:
    kind = _section_class(kind)  # an optional field takes its type's values
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{where} must be {kind.__name__}, got {type(value).__name__} "
                          f"{value!r}")
    return value


def from_dict(raw: dict) -> TrainConfig:
    sections = {}
    hints = typing.get_type_hints(TrainConfig)
    for name, table in raw.items():
        if name not in hints:
            raise ConfigError(f"unknown config section [{name}]; known: "
                              f"{', '.join(hints)}")
        if not isinstance(table, dict):
            raise ConfigError(f"[{name}] must be a table")
        cls = _section_class(hints[name])
        fields = typing.get_type_hints(cls)
        values = {}
        for key, value in table.items():
            if key not in fields:
                raise ConfigError(f"unknown field {name}.{key}; known: {', '.join(fields)}")
            values[key] = _coerce(f"{name}.{key}", value, fields[key])
        sections[name] = cls(**values)
    return TrainConfig(**sections)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`section.key=value`; the value is read as TOML (numbers, true/false, "strings"),
    and a bare word that is not valid TOML is taken as a string."""
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise ConfigError(f"--set expects section.key=value, got {item!r}")
    key, text = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    return key.strip().split("."), value


def load_config(path: Path | None, overrides: list[str] = ()) -> TrainConfig:
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no such config file")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({e})") from e
    for item in overrides:
        keys, value = parse_override(item)
        if len(keys) != 2:
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        raw.setdefault(keys[0], {})[keys[1]] = value
    return from_dict(raw)
