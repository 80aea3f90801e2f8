"""GGUF files (llama.cpp): config from metadata, dequantized weights, embedded tokenizer.

Dequantization is the `gguf` library's. llama.cpp's converter permutes the Q and K rows of
Llama-family weights for its interleaved RoPE; we undo that to get HF's half-split layout.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

from dspine_jax.checkpoints.params import TensorSource
from dspine_jax.config import ARCHITECTURES, TargetConfig
from dspine_jax.errors import CheckpointError, ConfigError

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                  "output": "lm_head"}


class GGUFCheckpoint:
    """An opened GGUF file. Tensors are dequantized lazily, one at a time."""

    def __init__(self, path: Path):
        import gguf  # imported here: only GGUF users pay for it

        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such GGUF file")
        check_size(self.path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # the reader raises ValueError/struct.error/... on bad bytes
            raise CheckpointError(f"{self.path}: corrupt or unsupported GGUF file ({e})") from e
        self.arch = self.field("general.architecture")
        self._tensors = {t.name: t for t in self.reader.tensors}

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def config(self) -> TargetConfig:
        a = self.arch
        if a not in ARCHITECTURES:
            raise ConfigError(f"{self.path}: unknown architecture {a!r} in general.architecture; "
                              "supported: llama, qwen3")
        heads = self.field(f"{a}.attention.head_count")
        hidden = self.field(f"{a}.embedding_length")
        vocab = self.field(f"{a}.vocab_size") or len(self.field("tokenizer.ggml.tokens", []))
        rope = {}
        kind = self.field(f"{a}.rope.scaling.type")
        if kind in ("linear", "yarn"):
            rope = {"rope_type": kind, "factor": self.field(f"{a}.rope.scaling.factor")}
            original = self.field(f"{a}.rope.scaling.original_context_length")
            if original:
                rope["original_max_position_embeddings"] = original
        elif kind not in (None, "none"):
            raise ConfigError(f"{self.path}: rope scaling {kind!r} is not supported")
        try:
            return TargetConfig(
                family=ARCHITECTURES[a],
                vocab_size=int(vocab),
                hidden_size=hidden,
                intermediate_size=self.field(f"{a}.feed_forward_length"),
                num_hidden_layers=self.field(f"{a}.block_count"),
                num_attention_heads=heads,
                num_key_value_heads=self.field(f"{a}.attention.head_count_kv") or heads,
                head_dim=self.field(f"{a}.attention.key_length") or hidden // heads,
                max_position_embeddings=self.field(f"{a}.context_length"),
                rms_norm_eps=float(self.field(f"{a}.attention.layer_norm_rms_epsilon")),
                rope_theta=float(self.field(f"{a}.rope.freq_base", 10000.0)),
                rope_scaling=tuple(sorted(rope.items())) or None,
                tie_word_embeddings="output.weight" not in self._tensors,
                attention_bias="blk.0.attn_q.bias" in self._tensors,
            )
        except TypeError as e:
            raise CheckpointError(f"{self.path}: metadata incomplete ({e})") from e

    def tensor_source(self) -> TensorSource:
        config = self.config()
        loaders = {}
        for name in self._tensors:
            hf = _hf_name(name)
            if hf is None:
                raise CheckpointError(f"{self.path}: unexpected tensor {name}")
            loaders[hf] = self._loader(name, config)
        return loaders

    def _loader(self, name: str, config: TargetConfig):
        def load() -> np.ndarray:
            from gguf import quants

            tensor = self._tensors[name]
            shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists dims inner-first
            try:
                array = quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            except Exception as e:
                raise CheckpointError(f"{self.path}: cannot dequantize {name} ({e})") from e
            array = array.astype(np.float32)
            if config.family == "llama" and ".attn_q." in name:
                array = _unpermute(array, config.num_attention_heads)
            elif config.family == "llama" and ".attn_k." in name:
                array = _unpermute(array, config.num_key_value_heads)
            return array
        return load


# GGUF metadata value types -> bytes per value; 8 is a string, 9 an array.
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
IMPLAUSIBLE = 1 << 40  # a length past 1 TiB is a corrupt field, not a cut-short file


class _PastEnd(Exception):
    """The header walk needed `needed` bytes of a shorter file."""

    def __init__(self, needed: int):
        self.needed = needed


class _HeaderWalk:
    """Reads a GGUF header just far enough to know how long the whole file must be: the
    gguf reader meets a cut-short file with numpy reshape/dtype errors that name no file."""

    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos, self.order = buf, size, 0, "<"

    def take(self, n: int) -> int:
        if n > IMPLAUSIBLE:
            raise ValueError(f"a field claims {n} bytes")
        start, self.pos = self.pos, self.pos + n
        if self.pos > self.size:
            raise _PastEnd(self.pos)
        return start

    def unpack(self, fmt: str) -> tuple:
        fmt = self.order + fmt
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))

    def string(self) -> bytes:
        (n,) = self.unpack("Q")
        start = self.take(n)
        return bytes(self.buf[start:start + n])

    def skip_value(self, kind: int) -> None:
        if kind == STRING:
            self.string()
        elif kind == ARRAY:
            item, count = self.unpack("IQ")
            if item in SCALAR_SIZES:
                self.take(count * SCALAR_SIZES[item])
            else:
                for _ in range(count):
                    self.skip_value(item)
        elif kind in SCALAR_SIZES:
            self.take(SCALAR_SIZES[kind])
        else:
            raise ValueError(f"unknown metadata type {kind}")

    def required_size(self) -> int:
        """Header, padding to the alignment, then the end of the furthest tensor."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        magic, version = self.unpack("4sI")
        if magic != b"GGUF":
            raise ValueError("not a GGUF file")
        if version & 0xFFFF == 0:  # written on a big-endian machine
            self.order = ">"
        num_tensors, num_fields = self.unpack("QQ")
        alignment = 32
        for _ in range(num_fields):
            key = self.string()
            (kind,) = self.unpack("I")
            if key == b"general.alignment" and kind == 4:
                (alignment,) = self.unpack("I")
            else:
                self.skip_value(kind)
        end = 0
        for _ in range(num_tensors):
            self.string()
            (ndim,) = self.unpack("I")
            dims = self.unpack(f"{ndim}Q")
            kind, offset = self.unpack("IQ")
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            elements = 1
            for d in dims:
                elements *= d
            end = max(end, offset + elements // block * type_size)
        data_start = -(-self.pos // max(alignment, 1)) * max(alignment, 1)
        return data_start + end


def check_size(path: Path) -> None:
    """Refuse a file shorter than its own header says it is, naming both sizes. Anything
    else odd about the header is left to the gguf reader to report."""
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{path}: truncated: 0 bytes (an empty file)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            needed = _HeaderWalk(buf, size).required_size()
        except _PastEnd as e:
            raise CheckpointError(f"{path}: truncated: {size} of at least {e.needed} bytes "
                                  "(the header alone runs past the end of the file); "
                                  "copy or download it again") from None
        except (ValueError, KeyError, struct.error):
            return
    if size < needed:
        raise CheckpointError(f"{path}: truncated: {size} of {needed} bytes; copy or "
                              "download it again")


def _hf_name(name: str) -> str | None:
    base, _, kind = name.rpartition(".")  # kind: weight or bias
    if base.startswith("blk."):
        _, layer, short = base.split(".", 2)
        return (f"model.layers.{layer}.{LAYER_TENSORS[short]}.{kind}"
                if short in LAYER_TENSORS else None)
    return f"{GLOBAL_TENSORS[base]}.{kind}" if base in GLOBAL_TENSORS else None


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave: GGUF rows run [head, H/2, 2], HF's
    half-split layout runs [head, 2, H/2]."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
