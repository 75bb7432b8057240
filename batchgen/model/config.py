"""A model's configuration: the dataclasses ``ModelConfig`` (what the modules are built from),
``MoeConfig`` (the experts of a mixture-of-experts model) and ``ModelInfo`` (what the rest of
batchgen needs to know: shapes, length, EOS ids), and the checks every architecture shares
(:func:`parse_base`: sizes, heads, RoPE, length). Which architectures exist, and what each adds
to the base (biases, q/k norms, experts), is :mod:`batchgen.model.registry`'s table; reading a
model folder's config goes through it (:func:`batchgen.model.registry.read_model_config`).

Every problem is a ``ModelError`` whose message is one line naming the problem and the path.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchgen.errors import ModelError

__all__ = [
    "SUPPORTED_ROPE_TYPES",
    "ModelConfig",
    "ModelInfo",
    "MoeConfig",
    "RopeConfig",
    "architecture_name",
    "is_gguf",
    "model_info",
    "parse_base",
    "parse_rope",
    "layer_windows",
    "qwen_windows",
    "raw_config",
]

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


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
    # the fraction of each head's dimensions that is rotated (the first ones)
    partial_rotary_factor: float = 1.0
    # longrope: per-pair divisors for positions below original_max_position_embeddings (short)
    # and from there on (long)
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None


@dataclass(frozen=True)
class MoeConfig:
    """The experts of a mixture-of-experts model (Qwen3-MoE, Qwen2-MoE, Mixtral).

    Each sparse layer's MLP is a router (``[hidden] -> [num_experts]`` logits, softmax in fp32),
    the ``top_k`` experts of highest probability (ties to the lowest expert id), their weights
    (the probabilities, divided by their sum when ``renormalize``) and the weighted sum of those
    experts' SwiGLU MLPs of width ``intermediate_size``; plus, with
    ``shared_expert_intermediate_size``, a shared SwiGLU MLP every token goes through, scaled by
    ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE). Layers not in ``sparse_layers`` have a dense
    MLP of ``ModelConfig.intermediate_size``.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[int, ...]  # ascending layer indices
    shared_expert_intermediate_size: int | None = None


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
    moe: MoeConfig | None = None  # None: a dense model
    # per layer: the attention window W (the layer's query at position p sees keys p-W+1..p),
    # 0 for full causal attention; empty: every layer full
    windows: tuple[int, ...] = ()

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dimensions RoPE rotates (the first ones)."""
        return int(self.head_dim * self.rope.partial_rotary_factor)

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s attention window, None for full causal attention."""
        return (self.windows[layer] or None) if self.windows else None


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
    max_model_len: int  # max_position_embeddings
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


def parse_rope(raw: dict[str, Any], path: Path, max_pos: int, default_theta: float) -> RopeConfig:
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
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) or 1.0
    theta = params.get("rope_theta", raw.get("rope_theta")) or default_theta
    # the pre-training length that llama3/yarn scale from (HF's default: max_position_embeddings)
    original = (
        raw.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or max_pos
    )
    factor = params.get("factor")
    try:
        if rope_type in ("yarn", "longrope") and factor is None:
            factor = max_pos / (original or max_pos)
        if rope_type == "longrope" and not (
            params.get("short_factor") and params.get("long_factor")
        ):
            raise ModelError(
                f"invalid config.json {path}: longrope needs short_factor and long_factor"
            )
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
            partial_rotary_factor=float(partial),
            short_factor=_opt_floats(params.get("short_factor")),
            long_factor=_opt_floats(params.get("long_factor")),
        )
    except (TypeError, ValueError) as err:
        raise ModelError(f"invalid rope parameters in {path}: {one_line(err)}") from None


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _opt_floats(value: Any) -> tuple[float, ...] | None:
    return None if value is None else tuple(float(v) for v in value)


def layer_windows(layer_types: list[str], window: int | None) -> tuple[int, ...]:
    """Per-layer windows (see ``ModelConfig.windows``) from HF ``layer_types``: ``window`` for
    each ``sliding_attention`` layer, 0 for the others; () when no layer is windowed."""
    windows = tuple(window if t == "sliding_attention" and window else 0 for t in layer_types)
    return windows if any(windows) else ()


def qwen_windows(
    raw: dict[str, Any], sliding: Callable[[int], bool] | None = None
) -> tuple[int, ...]:
    """The per-layer windows of a Qwen-style config: with ``use_sliding_window`` (or any
    ``sliding_attention`` layer type) and ``sliding_window``, the layers ``layer_types`` calls
    sliding, or, without layer types, those ``sliding(i)`` picks (default: from
    ``max_window_layers`` on, Qwen2's and Qwen3's rule)."""
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if not window or not (
        raw.get("use_sliding_window") or "sliding_attention" in (layer_types or [])
    ):
        return ()
    if layer_types is None:
        first = raw.get("max_window_layers", 28)
        rule = sliding or (lambda i: i >= first)
        count = raw.get("num_hidden_layers", 0)
        layer_types = ["sliding_attention" if rule(i) else "full_attention" for i in range(count)]
    return layer_windows(layer_types, window)


def raw_config(model_dir: str | Path) -> tuple[dict[str, Any], tuple[int, ...], Path]:
    """A model's config.json object (for a ``.gguf`` file: the same built from its metadata,
    :mod:`batchgen.model.gguf`), its EOS ids (config.json's plus generation_config.json's) and
    the path to name in messages."""
    root = model_path(model_dir)
    if is_gguf(root):
        from batchgen.model.gguf import GgufModel

        raw, eos = GgufModel.open(root).config_dict()
        return raw, eos, root
    path = root / "config.json"
    raw = read_json(path, "config.json")
    eos_list = _eos_ids(raw.get("eos_token_id"))
    gen_path = root / "generation_config.json"
    if gen_path.is_file():
        eos_list += _eos_ids(read_json(gen_path, "generation_config.json").get("eos_token_id"))
    return raw, tuple(dict.fromkeys(eos_list)), path


def architecture_name(raw: dict[str, Any], path: Path) -> str:
    """config.json's ``architectures[0]``; ModelError when it names none."""
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ModelError(f"config.json {path} names no architecture ('architectures' is missing)")
    return archs[0]


def req_int(raw: dict[str, Any], key: str, path: Path) -> int:
    """``raw[key]`` as a positive integer; ModelError naming the key otherwise."""
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelError(f"invalid config.json {path}: {key!r} must be a positive integer")
    return value


def parse_base(
    raw: dict[str, Any],
    path: Path,
    *,
    max_position_embeddings: int,
    window: int | tuple[int, ...] | None,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    partial_rotary: bool = False,
) -> ModelConfig:
    """The checks and fields every architecture shares, from a config.json object: sizes,
    heads, head_dim, activation (silu), length, RoPE. ``max_position_embeddings``,
    ``rope_theta`` and ``rms_norm_eps`` are the architecture's defaults for configs that leave them out
    (``partial_rotary``: whether the architecture rotates part of each head); ``window``
    is the attention window the architecture reads from the config: one for every layer, or
    per layer (0: full attention), or None (no window). Biases,
    q/k norms and experts are off: the architecture's parser turns them on
    (``dataclasses.replace``)."""
    arch = architecture_name(raw, path)
    hidden = req_int(raw, "hidden_size", path)
    num_heads = req_int(raw, "num_attention_heads", path)
    num_layers = req_int(raw, "num_hidden_layers", path)
    vocab = req_int(raw, "vocab_size", path)
    intermediate = req_int(raw, "intermediate_size", path)
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
    max_pos = raw.get("max_position_embeddings") or max_position_embeddings
    if not isinstance(max_pos, int) or max_pos <= 0:
        raise ModelError(
            f"invalid config.json {path}: max_position_embeddings must be a positive integer"
        )
    windows = (window,) * num_layers if isinstance(window, int) else tuple(window or ())
    if windows and (
        len(windows) != num_layers
        or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in windows)
    ):
        raise ModelError(
            f"invalid config.json {path}: sliding windows {window!r} for {num_layers} layers"
        )
    windows = windows if any(windows) else ()
    rope = parse_rope(raw, path, max_pos, rope_theta)
    rotated = head_dim * rope.partial_rotary_factor
    if rope.partial_rotary_factor != 1.0 and (
        not partial_rotary or rotated != int(rotated) or int(rotated) % 2 or rotated <= 0
    ):
        raise ModelError(
            f"unsupported partial_rotary_factor {rope.partial_rotary_factor} in {path}"
        )
    for factors in (rope.short_factor, rope.long_factor):
        if factors is not None and len(factors) != int(rotated) // 2:
            raise ModelError(
                f"invalid config.json {path}: {len(factors)} longrope factors for "
                f"{int(rotated)} rotated dimensions"
            )
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", rms_norm_eps)),
        max_model_len=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        rope=rope,
        windows=windows,
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
