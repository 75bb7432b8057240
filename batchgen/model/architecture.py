"""What an architecture family provides to the registry (:mod:`batchgen.model.registry`): how to
read its config.json, which module computes it, and where each of that module's parameters
comes from in a Hugging Face checkpoint.

Adding an architecture is one module under ``batchgen/model/families/`` defining an
:class:`Architecture` (plus its tests), and one line in the registry's table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torch import Tensor, nn

from batchgen.model.attention import AttentionBackend, AttentionMetadata
from batchgen.model.config import ModelConfig
from batchgen.model.layers.backend import LayerBackend

__all__ = ["Architecture", "CausalLM", "WeightPlan"]


class CausalLM(Protocol):
    """The interface of every model module (an ``nn.Module``) the engine runs."""

    cfg: ModelConfig

    def __call__(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_cache: Tensor,
        meta: AttentionMetadata,
        kv_scales: Tensor | None = None,
        keep: Tensor | None = None,
    ) -> Tensor:
        """input_ids ``[T]``, positions ``[T]``, the paged cache (and a quantized cache's
        scales) -> hidden ``[T, hidden]`` after the final norm; with ``keep [K]`` (sorted,
        unique rows) the hidden states of those rows only, ``[K, hidden]``, each as it is
        without ``keep`` (a model may compute only those rows' last-layer MLP)."""
        ...

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden ``[S, hidden]`` -> logits ``[S, vocab]`` float32."""
        ...

    def pack_weights(self) -> int:
        """Pre-pack weights for the layer backend's GEMM once loaded; returns how many."""
        ...


@dataclass(frozen=True)
class WeightPlan:
    """Where a model's parameters come from in a Hugging Face checkpoint.

    ``sources``: our parameter name -> the HF tensors that make it, concatenated along dim 0 in
    this order and then viewed as the parameter's shape (so per-expert ``[I, H]`` tensors of a
    checkpoint fill a stacked ``[E, 2I, H]`` parameter). ``shapes``: each of those HF tensors ->
    the shape its config implies (checked from the file headers before anything is read).
    ``transforms``: our parameter name -> a function of its HF tensors (in ``sources`` order, as
    loaded) returning the parameter, for checkpoints whose layout differs from ours beyond
    concatenation (gpt-oss's transposed, interleaved experts); the others are concatenated.
    """

    sources: dict[str, list[str]]
    shapes: dict[str, tuple[int, ...]]
    transforms: dict[str, Callable[[list[Tensor]], Tensor]] = field(default_factory=dict)

    def needed(self) -> list[str]:
        """Every HF tensor the plan reads, sorted."""
        return sorted({hf for names in self.sources.values() for hf in names})


@dataclass(frozen=True)
class Architecture:
    """One ``architectures[0]`` of config.json.

    ``parse(raw, path)``: the checked :class:`ModelConfig` of a config.json object (``path``
    names it in messages); ``model(cfg, attention, layers)``: the module, built on the meta device
    and loaded by the loader; ``weights(cfg, has)``: its :class:`WeightPlan`, where ``has(name)``
    tells whether the checkpoint holds an HF tensor (for architectures whose checkpoints come in
    more than one layout).
    """

    name: str
    parse: Callable[[dict[str, Any], Path], ModelConfig]
    model: Callable[[ModelConfig, AttentionBackend[Any], LayerBackend], nn.Module]
    weights: Callable[[ModelConfig, Callable[[str], bool]], WeightPlan]
