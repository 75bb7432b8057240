"""Tiny random models, tokenizers and prompts for tests, demos and benchmarks (fully offline).

``make_tiny_model`` writes a Hugging Face model folder: a random Llama / Mistral / Qwen2 / Qwen3 /
Gemma 2 / Gemma 3 / Phi-3, or mixture-of-experts Qwen3-MoE / Qwen2-MoE / Mixtral / gpt-oss, made with transformers' own config and
model classes (safetensors, sharded on request), and a
byte-level BPE tokenizer trained on a synthetic corpus of pseudo-words, with BOS/EOS and a small
chat template. Everything is deterministic given the seed.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "ARCHITECTURES",
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "make_words",
    "make_prompts",
    "train_tokenizer",
    "wrap_tokenizer",
    "make_tiny_model",
    "write_prompts_parquet",
]

# arch name -> (transformers config class name, architecture string in config.json)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}

# Special tokens take the first ids, in this order.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
PAD_ID, BOS_ID, EOS_ID, END_OF_TURN_ID = 0, 1, 2, 6

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CONSONANTS = "bdfghklmnprstvz"
_VOWELS = "aeiou"
_LEXICON_SIZE = 3000


@functools.lru_cache(maxsize=1)
def _lexicon() -> tuple[tuple[str, ...], tuple[float, ...]]:
    """A fixed list of distinct pseudo-words (1 to 4 syllables), the same in every process, and
    the cumulative Zipf-like weights to draw them with (a pure function, cached)."""
    rng = random.Random(1234)
    words: dict[str, None] = {}
    while len(words) < _LEXICON_SIZE:
        syllables = rng.choice((1, 2, 2, 3, 3, 4))
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))
        words[word] = None
    cum_weights = tuple(itertools.accumulate(1.0 / (rank + 10) for rank in range(len(words))))
    return tuple(words), cum_weights


def make_words(n: int, seed: int = 0) -> list[str]:
    """``n`` pseudo-words drawn from a fixed lexicon with a Zipf-like frequency (deterministic)."""
    lexicon, cum_weights = _lexicon()
    return random.Random(seed).choices(lexicon, cum_weights=cum_weights, k=n)


def make_prompts(
    num: int, seed: int = 0, min_words: int = 8, max_words: int = 64, prefix: str | None = None
) -> list[str]:
    """``num`` prompts of ``min_words..max_words`` pseudo-words each, optionally after ``prefix``."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        words = make_words(rng.randint(min_words, max_words), seed=seed * 1_000_003 + i)
        text = " ".join(words)
        prompts.append(f"{prefix} {text}" if prefix else text)
    return prompts


def _corpus(num_lines: int, seed: int) -> Iterator[str]:
    rng = random.Random(seed)
    for i in range(num_lines):
        words = make_words(rng.randint(4, 24), seed=seed * 7_919 + i)
        # some punctuation and capitals, so the tokenizer sees more than lowercase words
        line = " ".join(words).capitalize() + rng.choice((".", ".", "?", "!", ","))
        yield line


def train_tokenizer(vocab_size: int, seed: int = 0) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` of at most ``vocab_size`` tokens.

    BOS is prepended to every encoded text; the chat template renders
    ``<s><|role|>\\ncontent<|end|>\\n...`` and ends with ``<|assistant|>\\n`` for generation.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} for byte-level BPE"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    num_lines = max(500, vocab_size)  # enough text for the merges to fill the vocabulary
    tok.train_from_iterator(_corpus(num_lines, seed), trainer=trainer)
    return wrap_tokenizer(tok)


def wrap_tokenizer(tok: Any) -> Any:
    """A ``tokenizers.Tokenizer`` holding :data:`SPECIAL_TOKENS` at their ids, as a
    ``PreTrainedTokenizerFast`` that prepends BOS to every text and has the chat template."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1_000_000,
    )


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    initializer_range: float = 0.5,
    sharded: bool = False,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a random ``arch`` model plus tokenizer to ``out_dir`` and return the folder.

    Norm weights and biases are randomized too (transformers initializes them to 1 and 0), so a
    test notices a missing norm or bias. ``sharded`` splits the weights into about four
    safetensors shards with an index. ``config_overrides`` passes extra config keys (e.g.
    ``rope_parameters``).
    """
    import torch
    import transformers

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHITECTURES)}")
    config_cls_name, architecture = ARCHITECTURES[arch]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(vocab_size, seed=seed)
    assert len(tokenizer) <= vocab_size

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim if head_dim is not None else hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        architectures=[architecture],
    )
    kwargs.update(config_overrides or {})
    config = getattr(transformers, config_cls_name)(**kwargs)

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(initializer_range * torch.randn(param.shape, generator=gen))
    model.generation_config.eos_token_id = [EOS_ID, END_OF_TURN_ID]
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.pad_token_id = PAD_ID

    save_kwargs: dict[str, Any] = {}
    if sharded:
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        save_kwargs["max_shard_size"] = max(total // 4, 1)
    model.save_pretrained(out, **save_kwargs)
    tokenizer.save_pretrained(out)
    return out


def write_prompts_parquet(
    path: str | Path,
    num_rows: int,
    *,
    seed: int = 0,
    min_words: int = 8,
    max_words: int = 64,
    prefix: str | None = None,
) -> Path:
    """Write demo prompts as Parquet with columns ``id`` (int64) and ``prompt`` (string)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(
        num_rows, seed=seed, min_words=min_words, max_words=max_words, prefix=prefix
    )
    table = pa.table(
        {"id": pa.array(range(num_rows), pa.int64()), "prompt": pa.array(prompts, pa.string())}
    )
    pq.write_table(table, out)
    return out
