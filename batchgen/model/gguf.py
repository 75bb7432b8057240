"""GGUF files (llama.cpp's format) as models: one file holds the config (as metadata), the
tokenizer, the chat template and the weights, most of them quantized.

Read with the ``gguf`` package (llama.cpp's own reader). What this module maps:

- metadata ``{arch}.*`` -> a config.json object (:meth:`GgufModel.config_dict`), checked by
  :func:`batchgen.model.registry.parse_config` like any config.json;
- llama.cpp tensor names (``blk.N.attn_q.weight``) <-> Hugging Face names
  (``model.layers.N.self_attn.q_proj.weight``), so the loader's weight plan serves both formats;
- weights: dequantized to float32 one tensor at a time (the ``gguf`` package's numpy
  dequantizers), then cast to the compute dtype, so loading peaks at the final weights plus one
  float32 tensor. llama.cpp's converter permutes the rows of a Llama model's Q and K projections
  (its RoPE pairs adjacent dims, Hugging Face's pairs halves); they are permuted back here;
- the tokenizer: transformers' GGUF conversion (BPE ``gpt2`` and SentencePiece ``llama`` models),
  with BOS/EOS ids and the chat template from the metadata. The converted tokenizer is cached
  per file header under ``$BATCHGEN_CACHE`` (converting a large vocabulary takes seconds; the
  cached one loads in well under one).

Every problem is a ``ModelError`` whose message is one line naming the problem and the file.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchgen.errors import ModelError

__all__ = ["ARCHITECTURES", "SUPPORTED_TYPES", "GgufModel"]

# general.architecture -> config.json's architectures[0]. Mistral's GGUFs use "llama".
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Tensor types that load (each dequantized to float32 by the gguf package, then cast).
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip

# Hugging Face tensor name (per-layer part after "model.layers.N.") -> llama.cpp's ("blk.N.").
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")


def gguf_name(hf_name: str) -> str:
    """The llama.cpp name of a Hugging Face tensor name (KeyError for one GGUF has no name for)."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    m = _LAYER_RE.fullmatch(hf_name)
    if m is None:
        raise KeyError(hf_name)
    return f"blk.{m[1]}.{_LAYER_NAMES[m[2]]}.{m[3]}"


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


class GgufModel:
    """One opened GGUF file: its metadata and tensor index (the tensor data is memory-mapped and
    read only when a tensor is loaded). :meth:`open` caches by path, size and mtime."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self.path = path
        try:
            self._reader = GGUFReader(str(path), "r")
        except Exception as err:  # the reader raises ValueError, struct errors, OSError...
            raise ModelError(f"corrupt or unreadable GGUF file {path}: {_one_line(err)}") from None
        self._fields = self._reader.fields
        self.tensors = {t.name: t for t in self._reader.tensors}
        arch = self.field("general.architecture")
        if arch not in ARCHITECTURES:
            raise ModelError(
                f"unsupported GGUF architecture {arch!r} in {path}; supported: "
                f"{', '.join(ARCHITECTURES)}"
            )
        self.arch: str = arch
        for t in self.tensors.values():
            if t.tensor_type.name not in SUPPORTED_TYPES:
                raise ModelError(
                    f"unsupported GGUF tensor type {t.tensor_type.name} (tensor {t.name}) in "
                    f"{path}; supported: {', '.join(SUPPORTED_TYPES)}"
                )

    @staticmethod
    def open(path: Path) -> GgufModel:
        st = path.stat()
        return _open_cached(path.resolve(), st.st_size, st.st_mtime_ns)

    def field(self, key: str, default: Any = None) -> Any:
        f = self._fields.get(key)
        if f is None:
            return default
        return f.contents()

    # ---------------------------------------------------------------------------------------
    # config

    def config_dict(self) -> tuple[dict[str, Any], tuple[int, ...]]:
        """A config.json object with the model's settings, and its EOS ids."""
        a = self.arch
        get = functools.partial(self._arch_field, a)
        raw: dict[str, Any] = {
            "architectures": [ARCHITECTURES[a]],
            "hidden_size": get("embedding_length"),
            "intermediate_size": get("feed_forward_length"),
            "num_hidden_layers": get("block_count"),
            "num_attention_heads": get("attention.head_count"),
            "num_key_value_heads": get("attention.head_count_kv", None),
            "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
            "max_position_embeddings": get("context_length", None),
            "rope_theta": get("rope.freq_base", 10000.0),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "hidden_act": "silu",
        }
        embed = self.tensors.get("token_embd.weight")
        if embed is None:
            raise ModelError(f"tensor token_embd.weight missing from GGUF file {self.path}")
        raw["vocab_size"] = int(embed.shape[1])  # ne = [hidden, vocab]
        head_dim = get("attention.key_length", None)
        if head_dim is None and a == "llama":
            head_dim = get("rope.dimension_count", None)
        if head_dim is not None:
            raw["head_dim"] = head_dim
        if a == "llama":
            bias = "blk.0.attn_q.bias" in self.tensors
            raw["attention_bias"] = bias
            raw["mlp_bias"] = "blk.0.ffn_up.bias" in self.tensors
        scaling = get("rope.scaling.type", None)
        if scaling not in (None, "none"):
            params: dict[str, Any] = {"rope_type": scaling, "factor": get("rope.scaling.factor")}
            original = get("rope.scaling.original_context_length", None)
            if original is not None:
                params["original_max_position_embeddings"] = original
            raw["rope_scaling"] = params
        if "rope_freqs.weight" in self.tensors:  # Llama 3.1-style scaling, precomputed
            factors = self._dequantize(self.tensors["rope_freqs.weight"]).reshape(-1)
            rope_dim = head_dim or raw["hidden_size"] // raw["num_attention_heads"]
            if factors.size != rope_dim // 2:
                raise ModelError(
                    f"GGUF file {self.path}: rope_freqs.weight has {factors.size} entries; "
                    f"head_dim {rope_dim} needs {rope_dim // 2}"
                )
            raw["rope_parameters"] = {
                "rope_type": "default",
                "rope_theta": raw["rope_theta"],
                "freq_factors": factors.tolist(),
            }
        eos = [self.field("tokenizer.ggml.eos_token_id")]
        eot = self.field("tokenizer.ggml.eot_token_id")  # end of turn, where it differs
        return raw, tuple(dict.fromkeys(int(i) for i in [*eos, eot] if i is not None))

    def _arch_field(self, arch: str, key: str, *default: Any) -> Any:
        value = self.field(f"{arch}.{key}")
        if value is None:
            if default:
                return default[0]
            raise ModelError(f"GGUF file {self.path} lacks the metadata key {arch}.{key}")
        return value

    # ---------------------------------------------------------------------------------------
    # weights

    def shape(self, hf_name: str) -> tuple[int, ...] | None:
        """The Hugging Face shape of a tensor (rows first), None when the file lacks it."""
        t = self.tensors.get(gguf_name(hf_name))
        return None if t is None else tuple(int(n) for n in reversed(t.shape))

    def load(self, hf_name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """One tensor under its Hugging Face name and layout, dequantized and cast."""
        t = self.tensors[gguf_name(hf_name)]
        data = self._dequantize(t).reshape(self.shape(hf_name))
        if self.arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = self._arch_field("llama", "attention.head_count")
            if t.name.endswith("attn_k.weight"):
                heads = self._arch_field("llama", "attention.head_count_kv", heads)
            data = _unpermute_rows(data, heads)
        return torch.from_numpy(data).to(device=device, dtype=dtype)

    def _dequantize(self, t: Any) -> np.ndarray:
        """A tensor's values as a writable float32 array (in the file's row-major layout)."""
        from gguf.quants import dequantize

        try:
            data = dequantize(t.data, t.tensor_type)
        except Exception as err:
            raise ModelError(
                f"corrupt GGUF tensor {t.name} ({t.tensor_type.name}) in {self.path}: "
                f"{_one_line(err)}"
            ) from None
        # a copy where the data is the file's read-only memory map (F32 tensors)
        return np.array(data, dtype=np.float32, copy=not data.flags.writeable)

    def describe(self, dtype: torch.dtype) -> str:
        """``Q4_1 x210, F32 x61, Q8_0 x1; 98 MB file -> 538 MB in float32``."""
        counts = Counter(t.tensor_type.name for t in self.tensors.values())
        types = ", ".join(f"{name} x{n}" for name, n in counts.most_common())
        elements = sum(int(t.n_elements) for t in self.tensors.values())
        after = elements * torch.empty((), dtype=dtype).element_size()
        size = self.path.stat().st_size
        name = str(dtype).removeprefix("torch.")
        return f"{types}; {_mb(size)} file -> {_mb(after)} in {name}"

    # ---------------------------------------------------------------------------------------
    # tokenizer and identity

    def identity_parts(self) -> list[tuple[str, bytes]]:
        """The file's size and its whole header (metadata: config, tokenizer, chat template; the
        tensor index: names, types, shapes, offsets). The loader's identity adds a sample of the
        tensor bytes."""
        offset = int(self._reader.data_offset)
        with self.path.open("rb") as f:
            header = f.read(offset)
        return [(f"gguf:{self.path.stat().st_size}", header)]

    def tokenizer(self) -> Any:
        """The tokenizer, converted by transformers from the metadata (cached per identity)."""
        from transformers import AutoTokenizer

        cache = _tokenizer_cache(self)
        if (cache / "tokenizer_config.json").is_file():
            try:
                return AutoTokenizer.from_pretrained(str(cache), local_files_only=True)
            except Exception:  # a damaged cache entry: convert again
                pass
        try:
            tok = AutoTokenizer.from_pretrained(
                str(self.path.parent), gguf_file=self.path.name, local_files_only=True
            )
        except Exception as err:
            raise ModelError(
                f"cannot convert the tokenizer of GGUF file {self.path}: {_one_line(err)}"
            ) from None
        _save_atomically(tok, cache)
        return tok


@functools.lru_cache(maxsize=4)
def _open_cached(path: Path, size: int, mtime_ns: int) -> GgufModel:
    return GgufModel(path)


def _unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, rows (pair, half) -> (half, pair).

    [heads * d, hidden] with each head's rows ordered 0, d/2, 1, d/2+1, ... (llama.cpp's RoPE
    rotates adjacent pairs) -> ordered 0, 1, ..., d-1 (Hugging Face rotates the two halves)."""
    rows = w.shape[0]
    d = rows // heads
    return w.reshape(heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB"


def _tokenizer_cache(model: GgufModel) -> Path:
    """The cache folder of a file's converted tokenizer: keyed by its header and by the
    transformers version that converted it."""
    import transformers

    root = os.environ.get("BATCHGEN_CACHE") or Path.home() / ".cache" / "batchgen"
    digest = hashlib.sha256()
    for label, data in model.identity_parts():
        digest.update(label.encode() + b"\0" + data)
    name = f"{digest.hexdigest()[:32]}-{transformers.__version__}"
    return Path(root) / "gguf-tokenizers" / name


def _save_atomically(tok: Any, folder: Path) -> None:
    """Save a converted tokenizer; a cache that cannot be written is skipped, not an error."""
    import shutil
    import tempfile

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent))
        tok.save_pretrained(str(tmp))
        try:
            os.replace(tmp, folder)
        except OSError:  # another process saved it first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass
