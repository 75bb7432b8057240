"""A model's configuration: ``config.json`` parsed and checked into ``ModelConfig`` (what the
modules are built from) and ``ModelInfo`` (what the rest of batchgen needs to know: shapes, length,
EOS ids). Cheap: reads config.json and generation_config.json only, never weights.

Every problem is a ``ModelError`` whose message is one line naming the problem and the path.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchgen.errors import ModelError

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_ROPE_TYPES",
    "ModelConfig",
    "ModelInfo",
    "RopeConfig",
    "is_gguf",
    "model_info",
    "parse_config",
    "read_model_config",
    "read_model_info",
]

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# Defaults of the HF config classes for keys a config.json may leave out.
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048},
    "MistralForCausalLM": {"max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768},
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF ``rope_parameters`` / legacy ``rope_scaling``)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # per-pair divisors of the inverse frequencies [head_dim/2], applied before the scaling type
    # (a GGUF file's rope_freqs.weight: how llama.cpp stores Llama 3.1-style scaling)
    freq_factors: tuple[float, ...] | None = None


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to build the modules (parsed from config.json)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_model_len: int  # positions 0..max_model_len-1 are usable (RoPE tables cover them)
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: RopeConfig


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of batchgen needs to know about a model (cheap: from config.json only)."""

    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_model_len: int  # max_position_embeddings, capped by a sliding window
    eos_token_ids: tuple[int, ...]

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """KV-cache bytes one token occupies across all layers (K and V), for a cache of
        ``dtype``; a quantized cache (int8, float8_e4m3fn) adds its fp32 scale per KV head."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        scale_bytes = 4 if dtype in (torch.int8, torch.float8_e4m3fn) else 0
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * itemsize + scale_bytes)


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from a model file; ModelError when missing or malformed."""
    if not path.is_file():
        raise ModelError(f"{what} not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelError(f"invalid {what} {path}: {one_line(err)}") from None
    if not isinstance(data, dict):
        raise ModelError(f"invalid {what} {path}: expected a JSON object")
    return data


def one_line(err: BaseException) -> str:
    """An exception as one line, for ModelError messages."""
    return " ".join(str(err).split()) or type(err).__name__


def is_gguf(model: str | Path) -> bool:
    """Whether ``model`` names a GGUF file (llama.cpp's format) rather than a model folder."""
    return Path(model).suffix.lower() == ".gguf"


def model_path(model_dir: str | Path) -> Path:
    """The model folder (or GGUF file) as a Path, after checking it exists and can be read."""
    path = Path(model_dir)
    if is_gguf(path):
        if not path.is_file():
            raise ModelError(f"model file not found: {path}")
        if not os.access(path, os.R_OK):
            raise ModelError(f"cannot read model file {path}: permission denied")
        return path
    if not path.is_dir():
        raise ModelError(f"model folder not found: {path}")
    if not os.access(path, os.R_OK | os.X_OK):
        raise ModelError(f"cannot read model folder {path}: permission denied")
    return path


def _eos_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value)
    return []


def _parse_rope(raw: dict[str, Any], path: Path, max_pos: int) -> RopeConfig:
    """RoPE settings from transformers-5 ``rope_parameters`` or legacy ``rope_theta``/``rope_scaling``."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelError(f"invalid config.json {path}: rope_parameters must be an object")
    if (
        "rope_type" not in params
        and "type" not in params
        and params
        and all(isinstance(v, dict) for v in params.values())
    ):
        raise ModelError(f"unsupported config.json {path}: per-layer-type rope_parameters")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelError(
            f"unsupported rope type {rope_type!r} in {path}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ModelError(f"unsupported partial_rotary_factor {partial} in {path}")
    theta = params.get("rope_theta", raw.get("rope_theta")) or 10000.0
    # the pre-training length that llama3/yarn scale from (HF's default: max_position_embeddings)
    original = (
        raw.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or max_pos
    )
    factor = params.get("factor")
    try:
        if rope_type == "yarn" and factor is None:
            factor = max_pos / (original or max_pos)
        if rope_type in ("linear", "dynamic", "llama3", "yarn") and factor is None:
            raise ModelError(f"invalid config.json {path}: rope type {rope_type!r} needs 'factor'")
        return RopeConfig(
            rope_type=rope_type,
            theta=float(theta),
            factor=float(factor if factor is not None else 1.0),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(original) if original else None,
            attention_factor=_opt_float(params.get("attention_factor")),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=_opt_float(params.get("mscale")),
            mscale_all_dim=_opt_float(params.get("mscale_all_dim")),
            truncate=bool(params.get("truncate", True)),
            freq_factors=_opt_floats(params.get("freq_factors")),
        )
    except (TypeError, ValueError) as err:
        raise ModelError(f"invalid rope parameters in {path}: {one_line(err)}") from None


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _opt_floats(value: Any) -> tuple[float, ...] | None:
    return None if value is None else tuple(float(v) for v in value)


def _sliding_window(raw: dict[str, Any], arch: str) -> int | None:
    """The attention window of the model, if any layer uses one (else None)."""
    if arch == "MistralForCausalLM":
        return raw.get("sliding_window", _ARCH_DEFAULTS[arch]["sliding_window"])
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        window = raw.get("sliding_window")
        layer_types = raw.get("layer_types") or []
        uses = bool(raw.get("use_sliding_window")) or "sliding_attention" in layer_types
        return window if uses and window else None
    return None


def read_model_config(model_dir: str | Path) -> tuple[ModelConfig, tuple[int, ...]]:
    """Parse and check ``config.json`` (plus ``generation_config.json`` for EOS ids); for a
    ``.gguf`` file, the same from its metadata (:mod:`batchgen.model.gguf`)."""
    root = model_path(model_dir)
    if is_gguf(root):
        from batchgen.model.gguf import GgufModel

        raw, eos = GgufModel.open(root).config_dict()
        return parse_config(raw, root), eos
    path = root / "config.json"
    raw = read_json(path, "config.json")
    eos = _eos_ids(raw.get("eos_token_id"))
    gen_path = root / "generation_config.json"
    if gen_path.is_file():
        eos += _eos_ids(read_json(gen_path, "generation_config.json").get("eos_token_id"))
    return parse_config(raw, path), tuple(dict.fromkeys(eos))


def parse_config(raw: dict[str, Any], path: Path) -> ModelConfig:
    """Check a config.json object (``path`` names where it came from, for messages)."""
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ModelError(f"config.json {path} names no architecture ('architectures' is missing)")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"unsupported architecture {arch} in {path}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    defaults = _ARCH_DEFAULTS[arch]

    def req_int(key: str) -> int:
        value = raw.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelError(f"invalid config.json {path}: {key!r} must be a positive integer")
        return value

    hidden = req_int("hidden_size")
    num_heads = req_int("num_attention_heads")
    num_layers = req_int("num_hidden_layers")
    vocab = req_int("vocab_size")
    intermediate = req_int("intermediate_size")
    num_kv_heads = raw.get("num_key_value_heads") or num_heads
    head_dim = raw.get("head_dim") or hidden // num_heads
    if not isinstance(num_kv_heads, int) or num_heads % num_kv_heads != 0:
        raise ModelError(
            f"invalid config.json {path}: num_attention_heads {num_heads} is not a multiple of "
            f"num_key_value_heads {num_kv_heads}"
        )
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2 != 0:
        raise ModelError(
            f"invalid config.json {path}: head_dim {head_dim} must be a positive even integer"
        )
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelError(f"unsupported hidden_act {act!r} in {path}; supported: silu")
    max_pos = raw.get("max_position_embeddings") or defaults["max_position_embeddings"]
    if not isinstance(max_pos, int) or max_pos <= 0:
        raise ModelError(
            f"invalid config.json {path}: max_position_embeddings must be a positive integer"
        )
    # Sliding-window attention is not implemented: the usable length is capped at the window,
    # where windowed and full causal attention are identical.
    window = _sliding_window(raw, arch)
    max_model_len = min(max_pos, window) if isinstance(window, int) and window > 0 else max_pos
    rope = _parse_rope(raw, path, max_pos)

    # biases: Qwen2 always has them on q/k/v (never on o); Llama's attention_bias covers
    # q/k/v/o and Qwen3's too; Mistral has none; only Llama has mlp_bias
    attention_bias = bool(raw.get("attention_bias", False)) and arch != "MistralForCausalLM"
    qkv_bias = arch == "Qwen2ForCausalLM" or attention_bias
    o_bias = attention_bias and arch != "Qwen2ForCausalLM"
    mlp_bias = bool(raw.get("mlp_bias", False)) and arch == "LlamaForCausalLM"
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_model_len=max_model_len,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        qk_norm=arch == "Qwen3ForCausalLM",
        rope=rope,
    )


def model_info(cfg: ModelConfig, eos: tuple[int, ...]) -> ModelInfo:
    """The ``ModelInfo`` of a parsed config and its EOS ids."""
    return ModelInfo(
        architecture=cfg.architecture,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        max_model_len=cfg.max_model_len,
        eos_token_ids=eos,
    )


def read_model_info(model_dir: str | Path) -> ModelInfo:
    """``ModelInfo`` from config.json (and generation_config.json); reads no weights."""
    cfg, eos = read_model_config(model_dir)
    return model_info(cfg, eos)
