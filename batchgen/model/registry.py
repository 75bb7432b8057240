"""The architecture registry: config.json's ``architectures[0]`` -> its :class:`Architecture`
(config parser, model module, Hugging Face weight names), one table for the whole of batchgen.

Adding an architecture: a module under ``batchgen/model/families/`` defining its
``Architecture`` (and tests against transformers), and its line in :data:`ARCHITECTURES`.
Reading a model's config goes through here, so an architecture missing from the table is refused
the same way everywhere: ``ModelError`` naming it and listing the supported ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchgen.errors import ModelError
from batchgen.model.architecture import Architecture
from batchgen.model.config import (
    ModelConfig,
    ModelInfo,
    architecture_name,
    model_info,
    raw_config,
)
from batchgen.model.families import gemma, gpt_oss, llama, mixtral, phi3, qwen2_moe, qwen3_moe

__all__ = [
    "ARCHITECTURES",
    "SUPPORTED_ARCHITECTURES",
    "architecture",
    "parse_config",
    "read_model_config",
    "read_model_info",
]

ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        *llama.ARCHITECTURES,  # Llama, Mistral, Qwen2, Qwen3
        qwen3_moe.ARCHITECTURE,
        qwen2_moe.ARCHITECTURE,
        mixtral.ARCHITECTURE,
        *gemma.ARCHITECTURES,  # Gemma 2, Gemma 3 (text)
        phi3.ARCHITECTURE,  # Phi-3, Phi-4-mini
        gpt_oss.ARCHITECTURE,
    )
}

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def architecture(name: str, path: Path | str = "config.json") -> Architecture:
    """The registered architecture ``name``; ModelError naming it (and ``path``) otherwise."""
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise ModelError(
            f"unsupported architecture {name} in {path}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def parse_config(raw: dict[str, Any], path: Path) -> ModelConfig:
    """Check a config.json object (``path`` names where it came from, for messages) with its
    architecture's parser."""
    return architecture(architecture_name(raw, path), path).parse(raw, path)


def read_model_config(model_dir: str | Path) -> tuple[ModelConfig, tuple[int, ...]]:
    """Parse and check a model folder's ``config.json`` (plus ``generation_config.json`` for EOS
    ids), or a ``.gguf`` file's metadata; reads no weights."""
    raw, eos, path = raw_config(model_dir)
    return parse_config(raw, path), eos


def read_model_info(model_dir: str | Path) -> ModelInfo:
    """``ModelInfo`` from config.json (and generation_config.json); reads no weights."""
    cfg, eos = read_model_config(model_dir)
    return model_info(cfg, eos)
