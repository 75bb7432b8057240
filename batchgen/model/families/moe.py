"""Mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE, Mixtral): the Llama-family decoder whose
sparse layers' MLP is a router plus experts (:class:`SparseMoeBlock`), and the Hugging Face
weight names of those layers in both layouts checkpoints come in. The architectures themselves
(config parsing, names) are :mod:`qwen3_moe`, :mod:`qwen2_moe` and :mod:`mixtral`.

A sparse layer's MLP, for normed input x ``[T, hidden]``:

    weights, ids = route(gate(x), top_k, renormalize)        # [T, k] fp32, [T, k] int64
    y = sum_j weights[:, j] * expert_{ids[:, j]}(x)           # fp32, FusedExperts
    y += sigmoid(shared_expert_gate(x)) * shared_expert(x)    # Qwen2-MoE only
    residual += y                                             # rounded once to the model dtype

Routing, the tie rule and the fused expert compute are :mod:`batchgen.model.layers.moe`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from batchgen.errors import ModelError
from batchgen.model.architecture import WeightPlan
from batchgen.model.attention import AttentionBackend
from batchgen.model.config import ModelConfig, MoeConfig
from batchgen.model.families.llama import (
    LlamaForCausalLM,
    LlamaMLP,
    attention_weights,
    dense_mlp_weights,
    in_row_slices,
    model_weights,
)
from batchgen.model.layers.backend import LayerBackend
from batchgen.model.layers.linear import Linear
from batchgen.model.layers.moe import FusedExperts, route
from batchgen.model.packed_linear import Mkl

__all__ = [
    "ExpertNames",
    "MoeForCausalLM",
    "SparseMoeBlock",
    "moe_config",
    "moe_weights",
    "sparse_layers",
]

# tokens per pass through a sparse block on the CPU: bounds the gathered [T * k, H] rows and the
# [rows, 2I] intermediates of a long prefill chunk (like LlamaMLP's slices)
_MOE_ROWS = 1024


def sparse_layers(
    num_layers: int, decoder_sparse_step: int, mlp_only_layers: list[int]
) -> tuple[int, ...]:
    """The layers whose MLP is sparse, by the Qwen-MoE rule: every ``decoder_sparse_step``-th
    layer (``(i + 1) % step == 0``) that is not in ``mlp_only_layers``."""
    return tuple(
        i
        for i in range(num_layers)
        if i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    )


def moe_config(
    raw: dict[str, Any],
    path: Path,
    num_layers: int,
    *,
    num_experts: int,
    top_k: int,
    intermediate_size: int,
    renormalize: bool,
    shared_expert_intermediate_size: int | None = None,
) -> MoeConfig:
    """The experts of a config.json object; the keyword arguments are the architecture's
    values or defaults (the HF config class's) for keys the config leaves out. Reads
    ``num_experts`` (or ``num_local_experts``), ``num_experts_per_tok``,
    ``decoder_sparse_step`` and ``mlp_only_layers``; ModelError when one is invalid."""

    def positive(key: str, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelError(f"invalid config.json {path}: {key!r} must be a positive integer")
        return value

    experts = positive(
        "num_experts", raw.get("num_experts") or raw.get("num_local_experts") or num_experts
    )
    k = positive("num_experts_per_tok", raw.get("num_experts_per_tok", top_k))
    if k > experts:
        raise ModelError(
            f"invalid config.json {path}: num_experts_per_tok {k} exceeds num_experts {experts}"
        )
    step = positive("decoder_sparse_step", raw.get("decoder_sparse_step") or 1)
    mlp_only = raw.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
        raise ModelError(
            f"invalid config.json {path}: 'mlp_only_layers' must be a list of integers"
        )
    return MoeConfig(
        num_experts=experts,
        top_k=k,
        intermediate_size=positive("moe_intermediate_size", intermediate_size),
        renormalize=renormalize,
        sparse_layers=sparse_layers(num_layers, step, mlp_only),
        shared_expert_intermediate_size=(
            None
            if shared_expert_intermediate_size is None
            else positive("shared_expert_intermediate_size", shared_expert_intermediate_size)
        ),
    )


class SparseMoeBlock(nn.Module):
    """Router, experts and (Qwen2-MoE) the gated shared expert; ``forward(x, residual)`` adds
    the block's output to residual in place, like :class:`LlamaMLP`."""

    def __init__(self, cfg: ModelConfig, layers: LayerBackend) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.gate = Linear(cfg.hidden_size, moe.num_experts, bias=False)  # router
        self.experts = FusedExperts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, layers)
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = None if shared is None else LlamaMLP(cfg, layers, shared)
        self.shared_expert_gate = None if shared is None else Linear(cfg.hidden_size, 1, bias=False)
        self.max_rows = _MOE_ROWS if layers.device.type == "cpu" else None

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        """x ``[T, hidden]`` normed input -> ``residual += moe(x)``, in place."""
        return in_row_slices(self._forward, x, residual, self.max_rows)

    def _forward(self, x: Tensor, residual: Tensor) -> Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)  # [T, k] each
        y = self.experts(x, weights, ids)  # [T, hidden] fp32
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            shared = self.shared_expert(x, torch.zeros_like(x))  # [T, hidden]
            scale = torch.sigmoid(self.shared_expert_gate(x).float())  # [T, 1]
            y.addcmul_(shared.float(), scale)
        return residual.add_(y.to(residual.dtype))


class MoeForCausalLM(LlamaForCausalLM):
    """The Llama-family decoder with a :class:`SparseMoeBlock` as the MLP of the config's sparse
    layers (a dense SwiGLU of ``intermediate_size`` elsewhere). Parameter names: those of
    :class:`LlamaForCausalLM`, with, in sparse layers, ``layers.{i}.mlp.gate.weight`` [E, hidden],
    ``layers.{i}.mlp.experts.gate_up_proj`` [E, 2I, hidden], ``layers.{i}.mlp.experts.down_proj``
    [E, hidden, I] and, with a shared expert, ``layers.{i}.mlp.shared_expert.gate_up_proj.weight``,
    ``layers.{i}.mlp.shared_expert.down_proj.weight`` and ``layers.{i}.mlp.shared_expert_gate.weight``
    [1, hidden]."""

    def __init__(
        self, cfg: ModelConfig, attention: AttentionBackend[Any], layers: LayerBackend
    ) -> None:
        assert cfg.moe is not None
        super().__init__(cfg, attention, layers)

    @staticmethod
    def make_mlp(cfg: ModelConfig, index: int, layers: LayerBackend) -> nn.Module:
        assert cfg.moe is not None
        if index in cfg.moe.sparse_layers:
            return SparseMoeBlock(cfg, layers)
        return LlamaMLP(cfg, layers)

    def pack_weights(self) -> int:
        """The dense layers' packing (:meth:`LlamaForCausalLM.pack_weights`), plus, with MKL
        (CPU fp32 where torch has no oneDNN) and without the C kernels, each expert's two
        weights. Where the C kernels
        run the experts (:meth:`FusedExperts._pairs_cpu`), the stacked weights stay: the kernel
        reads them, and the GEMMs of its large experts on stacked weights were as fast as
        MKL-packed ones (Qwen3-30B-A3B's expert shape, one thread: 256 and 1,024 tokens within
        4%). oneDNN-packed experts (bf16) are slower than ``F.linear`` on the stacked weights:
        64 tokens 288 ms packed against 150 ms, 1,024 tokens 1,608 against 574 (AMD EPYC,
        AVX512-BF16, one thread)."""
        count = super().pack_weights()
        gemm = self.layer_backend.gemm
        if not isinstance(gemm, Mkl):
            return count
        for module in self.modules():
            if isinstance(module, FusedExperts) and module.cpu is None:
                count += module.pack(gemm)
        return count


@dataclass(frozen=True)
class ExpertNames:
    """How a checkpoint names a sparse layer's tensors in the per-expert layout the hub's
    checkpoints (and transformers 5's ``save_pretrained``) use:
    ``model.layers.{i}.{block}gate.weight`` (router) and
    ``model.layers.{i}.{block}experts.{e}.{gate|up|down}.weight``. transformers' fused layout
    (``model.layers.{i}.mlp.experts.gate_up_proj`` [E, 2I, H], ``...down_proj`` [E, H, I],
    router ``mlp.gate.weight``) is the same for every architecture."""

    block: str  # "mlp." (Qwen) or "block_sparse_moe." (Mixtral)
    gate: str  # "gate_proj" or "w1"
    up: str  # "up_proj" or "w3"
    down: str  # "down_proj" or "w2"


def moe_weights(cfg: ModelConfig, has: Callable[[str], bool], names: ExpertNames) -> WeightPlan:
    """The weight plan of a MoE model: attention as the Llama family's; in sparse layers the
    router, the experts (fused layout when the checkpoint holds layer i's fused tensor, else
    per expert) and the shared expert; dense layers' SwiGLU elsewhere."""
    moe = cfg.moe
    assert moe is not None

    def layer(i: int, plan: WeightPlan) -> None:
        attention_weights(cfg, i, plan)
        hf, ours = f"model.layers.{i}.", f"layers.{i}.mlp."
        if i not in moe.sparse_layers:
            dense_mlp_weights(cfg, hf + "mlp.", ours, plan)
            return
        _experts_weights(cfg, moe, has, names, i, plan)
        if moe.shared_expert_intermediate_size is not None:
            inter = moe.shared_expert_intermediate_size
            dense_mlp_weights(cfg, hf + "mlp.shared_expert.", ours + "shared_expert.", plan, inter)
            plan.sources[ours + "shared_expert_gate.weight"] = [
                hf + "mlp.shared_expert_gate.weight"
            ]
            plan.shapes[hf + "mlp.shared_expert_gate.weight"] = (1, cfg.hidden_size)

    return model_weights(cfg, layer)


def _experts_weights(
    cfg: ModelConfig,
    moe: MoeConfig,
    has: Callable[[str], bool],
    names: ExpertNames,
    i: int,
    plan: WeightPlan,
) -> None:
    h, inter, e_count = cfg.hidden_size, moe.intermediate_size, moe.num_experts
    hf, ours = f"model.layers.{i}.", f"layers.{i}.mlp."
    fused = hf + "mlp.experts."
    src, shapes = plan.sources, plan.shapes
    if has(fused + "gate_up_proj"):
        src[ours + "gate.weight"] = [hf + "mlp.gate.weight"]
        shapes[hf + "mlp.gate.weight"] = (e_count, h)
        src[ours + "experts.gate_up_proj"] = [fused + "gate_up_proj"]
        src[ours + "experts.down_proj"] = [fused + "down_proj"]
        shapes[fused + "gate_up_proj"] = (e_count, 2 * inter, h)
        shapes[fused + "down_proj"] = (e_count, h, inter)
        return
    block = hf + names.block
    src[ours + "gate.weight"] = [block + "gate.weight"]
    shapes[block + "gate.weight"] = (e_count, h)
    # [gate_0; up_0; gate_1; up_1; ...] concatenated: [E * 2I, H], viewed as [E, 2I, H]
    gate_up: list[str] = []
    down: list[str] = []
    for e in range(e_count):
        expert = f"{block}experts.{e}."
        gate_up += [expert + f"{names.gate}.weight", expert + f"{names.up}.weight"]
        down.append(expert + f"{names.down}.weight")
        shapes[expert + f"{names.gate}.weight"] = (inter, h)
        shapes[expert + f"{names.up}.weight"] = (inter, h)
        shapes[expert + f"{names.down}.weight"] = (h, inter)
    src[ours + "experts.gate_up_proj"] = gate_up
    src[ours + "experts.down_proj"] = down  # [E * H, I] viewed as [E, H, I]
