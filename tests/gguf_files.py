"""Tiny GGUF files for tests: a Hugging Face model folder (batchgen.tiny_model) written as
llama.cpp's converter would write it, with each tensor in a chosen type.

What the converter does and this repeats: metadata under the architecture's prefix, the BPE
tokenizer as token list + merges (``tokenizer.ggml.model = gpt2``), llama's Q/K rows permuted
(pairs of adjacent dims, llama.cpp's RoPE), tensor shapes written innermost-first.

Types the ``gguf`` package cannot quantize to (the K-quants, IQ4_NL) are written as random blocks with
small, finite scales: the weights are then whatever those blocks dequantize to, the same for
every reader, which is all a parity test needs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from batchgen.model.gguf import gguf_name

GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}

# Types written as random blocks: the byte offsets of each block's float16 scales (d, and dmin
# where it has one) within the block (ggml's block_q*_K and block_iq4_nl structs).
_RANDOM_BLOCKS = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
}

def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: per head, halves interleaved into adjacent pairs."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(rope: dict, theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's converter's rope_freqs for Llama 3.1-style scaling: per pair, the divisor of
    its inverse frequency (1 for short wavelengths, ``factor`` for long ones, smoothed between)."""
    import math

    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / head_dim))
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _encode(w: np.ndarray, type_name: str, rng: np.random.Generator) -> tuple[np.ndarray, object]:
    """(data, GGMLQuantizationType) of ``w`` [rows, cols] in ``type_name``."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[type_name]
    if type_name == "F32":
        return w.astype(np.float32), qtype
    if type_name not in _RANDOM_BLOCKS:
        return quantize(w.astype(np.float32), qtype), qtype
    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = w.shape
    assert cols % block == 0, f"{type_name} needs rows of a multiple of {block} elements"
    blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in _RANDOM_BLOCKS[type_name]:
        scale = np.array([rng.uniform(2e-4, 6e-4)], dtype=np.float16).view(np.uint8)
        blocks[:, :, offset : offset + 2] = scale
    return blocks.reshape(rows, -1), qtype


def write_gguf(
    model_dir: Path,
    out: Path,
    types: dict[str, str] | None = None,
    default: str = "F32",
    arch: str | None = None,
    seed: int = 0,
) -> Path:
    """Write ``model_dir`` (a tiny HF model folder) as the GGUF file ``out``.

    ``types`` maps llama.cpp tensor names to a type name (``Q4_K``...); others get ``default``
    (1-D tensors, norms and biases, stay F32 as llama.cpp keeps them). ``arch`` overrides the
    architecture written (to make files batchgen must refuse)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    name = arch or GGUF_ARCH[cfg["architectures"][0]]
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors |= load_file(str(file))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads

    w = gguf.GGUFWriter(str(out), name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta") or rope["rope_theta"])
    w.add_rope_freq_base(theta)
    if rope.get("rope_type") == "llama3":
        factors = _llama3_rope_freqs(rope, theta, head_dim)
        w.add_tensor("rope_freqs.weight", factors, raw_shape=factors.shape)
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"])
    _add_tokenizer(w, model_dir, cfg["vocab_size"])

    rng = np.random.default_rng(seed)
    for hf, value in sorted(tensors.items()):
        if hf == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        data = value.astype(np.float32)
        gname = gguf_name(hf)  # checked independently: tests compare with transformers' reader
        if name == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            data = _permute(data, heads if "attn_q" in gname else kv_heads)
        type_name = (types or {}).get(gname, default) if data.ndim == 2 else "F32"
        encoded, qtype = _encode(data, type_name, rng)
        w.add_tensor(gname, encoded, raw_shape=encoded.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tokenizer(w, model_dir: Path, vocab_size: int) -> None:
    """The folder's byte-level BPE tokenizer as llama.cpp's ``gpt2`` tokenizer metadata."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab |= special
    tokens = [""] * vocab_size
    types = [1] * vocab_size  # 1 normal, 3 control, 5 unused
    for text, i in vocab.items():
        tokens[i] = text
        if text in special:
            types[i] = 3
    for i, text in enumerate(tokens):
        if not text:
            tokens[i], types[i] = f"[PAD{i}]", 5
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[cfg.get("bos_token", "<s>")])
    w.add_eos_token_id(vocab[cfg.get("eos_token", "</s>")])
    w.add_add_bos_token(True)
    template = cfg.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    if template:
        w.add_chat_template(template)
