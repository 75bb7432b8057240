"""Mixture-of-experts compute: the router's top-k (:func:`route`) and the experts' SwiGLU MLPs
over the tokens routed to them (:class:`FusedExperts`), its implementation chosen once at load.

Routing. Probabilities are ``softmax(logits)`` in fp32 over all experts; a token goes to the
``top_k`` experts of highest probability, **ties broken to the lowest expert id** (a stable
descending sort: the rule holds on every device and path, which all route through this
function), in descending order of probability; its weights are those probabilities, divided by
their sum when ``renormalize`` (Qwen's ``norm_topk_prob``; always for Mixtral, where that equals a
softmax over the selected experts' logits). Weights stay fp32.

Expert compute (no loop over tokens, no compute for experts that got no token). A step's
``P = T * top_k`` (token, slot) pairs are sorted by expert id (stably: within an expert, by
token, then slot), so each expert's pairs are one contiguous slice; each expert with pairs runs
its gate-up GEMM, SwiGLU and down GEMM over its slice only; then the pairs' outputs are put back
in (token, slot) order and combined in one pass: ``out[t] = sum_j w[t, j] * y[t, j]`` in fp32,
summed in slot order (so a token's result does not depend on which other tokens share the
step, up to the GEMMs' rounding for other row counts).

- CPU with the C kernels (:meth:`batchgen.model.cpu_kernels.CpuKernels.moe_experts`): the
  experts with few pairs (:meth:`FusedExperts.kernel_rows`; in decode steps usually all) in one
  call: a task is 16 weight rows of one expert, so each selected expert's weights are streamed
  once (``F.linear`` on a few rows of a stacked expert weight ran at a few GB/s); the experts
  with more pairs (prefill chunks) as GEMMs on the stacked weights; then the combine in C
  (:meth:`~batchgen.model.cpu_kernels.CpuKernels.moe_combine`), each pair's output read where
  its expert wrote it.
- CPU without them (and any device without Triton): PyTorch GEMMs, a Python loop over the
  experts that have pairs (at most ``num_experts`` iterations per layer, whatever the token
  count); in fp32 with MKL, each expert's two weights are packed once at load
  (:meth:`FusedExperts.pack`) like the dense layers'.
- CUDA: the grouped-GEMM Triton kernel ``batchgen.kernels.fused_moe`` (each expert's slice
  padded to the kernel's row tile, every tile of every expert in one launch per GEMM; no host
  sync), then the same combine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchgen.model.layers.activation import SiluMul, silu_mul
from batchgen.model.layers.backend import LayerBackend
from batchgen.model.layers.linear import PackedLayer, pack_linear
from batchgen.model.packed_linear import Mkl

__all__ = [
    "CPU_KERNEL_ROWS",
    "CPU_KERNEL_ROWS_DPBF16",
    "FusedExperts",
    "experts_reference",
    "route",
    "sort_by_expert",
]

# On the CPU, an expert with at most this many pairs in a step runs in the C kernel (a stream
# over its weights), one with more as GEMMs (which reuse each weight across rows better).
# Measured at Qwen3-30B-A3B's expert shape, one thread, cores shared with other jobs (AMD EPYC,
# AVX512-BF16): with every expert in the kernel it was 1.4-4.4x faster than the GEMMs at 1-2
# pairs per expert and 0.7-0.8x at 16-64.
CPU_KERNEL_ROWS = 8
# The same limit for bf16 where the kernel's dot products are AVX512-BF16 instructions over 4
# weight rows x 4 pairs at a time. Measured at that shape, 2 threads (AMD EPYC Zen 5, bf16, 128
# experts, top 8, every expert's pairs in the kernel against torch's GEMMs): 1024 pairs (8 per
# expert) 40 against 54 ms with the limit at 8; 2048 pairs 55 against 92 ms; 8192 pairs 141
# against 146 ms; 32,768 pairs (256 per expert) 518 against 450 ms, so GEMMs from 64 up.
CPU_KERNEL_ROWS_DPBF16 = 64


def route(logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """Router logits ``[T, E]`` (any float dtype) -> weights ``[T, top_k]`` fp32 and expert ids
    ``[T, top_k]`` int64, in descending order of probability, ties to the lowest expert id."""
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    # stable: among equal probabilities the lower expert id comes first
    top, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, ids = top[:, :top_k], ids[:, :top_k]
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, ids


def sort_by_expert(ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """Expert ids ``[T, k]`` -> ``order [P]`` int64 (the (token, slot) pairs, flat index
    ``t * k + j``, sorted by expert, stably) and ``counts [E]`` int64 (pairs per expert)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


def combine(pair_out: Tensor, weights: Tensor) -> Tensor:
    """Pair outputs ``[T * k, H]`` in (token, slot) order and weights ``[T, k]`` fp32 ->
    ``[T, H]`` fp32, each token's weighted outputs summed in slot order."""
    t, k = weights.shape
    y = pair_out.view(t, k, -1).float()
    out = y[:, 0] * weights[:, :1]
    for j in range(1, k):
        out.addcmul_(y[:, j], weights[:, j : j + 1])
    return out


def experts_reference(
    x: Tensor, gate_up: Tensor, down: Tensor, weights: Tensor, ids: Tensor
) -> Tensor:
    """The definition, token by token and slot by slot (for tests; slow): x ``[T, H]``,
    gate_up ``[E, 2I, H]``, down ``[E, H, I]``, weights ``[T, k]`` fp32, ids ``[T, k]`` ->
    ``[T, H]`` fp32. Intermediate values are rounded to x's dtype where the fused paths round
    them (after each GEMM and after SwiGLU)."""
    t, k = ids.shape
    inter = down.shape[2]
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    for i in range(t):
        for j in range(k):
            e = int(ids[i, j])
            h = F.linear(x[i : i + 1], gate_up[e])  # [1, 2I]
            act = F.silu(h[:, :inter]) * h[:, inter:]
            y = F.linear(act, down[e])  # [1, H]
            out[i] += weights[i, j] * y[0].float()
    return out


class FusedExperts(nn.Module):
    """``num_experts`` SwiGLU MLPs of width ``intermediate``, stacked: ``gate_up_proj
    [E, 2I, H]`` (each expert's gate rows, then its up rows) and ``down_proj [E, H, I]`` (the
    layout of transformers' fused experts). ``forward(x, weights, ids)`` -> the weighted sum of
    each token's experts, fp32 (see the module docstring)."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        layers: LayerBackend,
        bias: bool = False,
        activation: SiluMul | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden = hidden
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        # gpt-oss: biases [E, 2I] and [E, H], and its clamped SwiGLU (``activation``, in place
        # on [n, 2I] -> [n, I] like silu_mul_)
        self.gate_up_bias = (
            nn.Parameter(torch.empty(num_experts, 2 * intermediate)) if bias else None
        )
        self.down_bias = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None
        self.silu_mul_: SiluMul = silu_mul(layers) if activation is None else activation
        # CUDA: the Triton kernel (the parameters stay stacked; nothing is packed there), which
        # has no biases or other activations: those experts run the PyTorch loop
        self.use_triton = layers.device.type == "cuda" and not bias and activation is None
        # CPU: the C kernel when it could be built (the parameters stay stacked), for the plain
        # SwiGLU experts without biases
        self.cpu = layers.cpu if not bias and activation is None else None
        # per expert, once packed (pack): the two GEMMs' packed layers; None: the parameters
        self.packed: list[tuple[PackedLayer, PackedLayer]] | None
        self.packed = None

    def pack(self, gemm: Mkl) -> int:
        """Pack each expert's weights for ``gemm`` (MKL, or oneDNN, which the model does not
        use for experts), dropping the stacked parameters; returns how many layers were
        packed."""
        if self.gate_up_bias is not None:  # biased experts stay on F.linear
            return 0
        packed = []
        for e in range(self.num_experts):
            packed.append(
                (
                    pack_linear(self.gate_up_proj[e], None, gemm),  # [2I, H]
                    pack_linear(self.down_proj[e], None, gemm),  # [H, I]
                )
            )
        self.packed = packed
        del self.gate_up_proj, self.down_proj
        return 2 * len(packed)

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """x ``[T, H]``, weights ``[T, k]`` fp32, ids ``[T, k]`` int64 -> ``[T, H]`` fp32."""
        if self.use_triton:
            from batchgen.kernels import fused_moe

            return combine(fused_moe(x, self.gate_up_proj, self.down_proj, ids), weights)
        if self.cpu is not None and self.packed is None:
            return self._combined_cpu(x, weights, ids)
        return combine(self._pairs_torch(x, ids), weights)

    def _combined_cpu(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """:meth:`forward` with the experts that have at most :meth:`kernel_rows` pairs in the C
        kernel (one call), the others as GEMMs, and the combine in C, reading each pair's output
        where its expert wrote it (no scatter back to (token, slot) order, no fp32 copy)."""
        k = ids.shape[1]
        order, counts = sort_by_expert(ids, self.num_experts)
        starts = counts.new_zeros(self.num_experts + 1)
        torch.cumsum(counts, 0, out=starts[1:])
        rows = order // k  # pair i's token row, sorted by expert
        x = x.contiguous()
        out = x.new_empty(order.shape[0], self.hidden)  # [P, H], sorted like rows
        limit = self.kernel_rows(x.dtype)
        self.cpu.moe_experts(x, rows, starts, self.gate_up_proj, self.down_proj, out, limit)
        big = (counts > limit).nonzero().flatten().tolist()
        if big:
            at = starts.tolist()
            for e in big:
                seg = x.index_select(0, rows[at[e] : at[e + 1]])
                self._expert(e, seg, out[at[e] : at[e + 1]])
        pos = torch.empty_like(order)
        pos[order] = torch.arange(order.shape[0])  # pair (t, j)'s row of out
        return self.cpu.moe_combine(out, pos, weights.contiguous())

    def kernel_rows(self, dtype: torch.dtype) -> int:
        """The most pairs an expert may have in a step to run in the C kernel."""
        assert self.cpu is not None
        dp = dtype == torch.bfloat16 and self.cpu.avx512bf16
        return CPU_KERNEL_ROWS_DPBF16 if dp else CPU_KERNEL_ROWS

    def _pairs_torch(self, x: Tensor, ids: Tensor) -> Tensor:
        """x ``[T, H]``, ids ``[T, k]`` -> each pair's expert output ``[T * k, H]`` in x's dtype,
        in (token, slot) order: one gather, a GEMM pair per expert that has pairs, one scatter."""
        k = ids.shape[1]
        order, counts = sort_by_expert(ids, self.num_experts)
        rows = x.index_select(0, order // k)  # [P, H]: pair i's token row, sorted by expert
        out = torch.empty_like(rows)  # [P, H], sorted like rows
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            self._expert(e, rows[start : start + n], out[start : start + n])
            start += n
        pair_out = torch.empty_like(out)
        pair_out[order] = out  # back to (token, slot) order
        return pair_out

    def _expert(self, e: int, seg: Tensor, out: Tensor) -> None:
        """Expert ``e``'s MLP as GEMMs: rows seg ``[n, H]`` -> out ``[n, H]`` (written)."""
        if self.gate_up_bias is not None:
            assert self.down_bias is not None and self.packed is None
            act = self.silu_mul_(F.linear(seg, self.gate_up_proj[e], self.gate_up_bias[e]))
            out.copy_(F.linear(act, self.down_proj[e], self.down_bias[e]))
        elif self.packed is None:
            act = self.silu_mul_(F.linear(seg, self.gate_up_proj[e]))  # [n, I]
            torch.mm(act, self.down_proj[e].t(), out=out)
        else:
            gate_up, down = self.packed[e]
            out.copy_(down(self.silu_mul_(gate_up(seg))))

    def extra_repr(self) -> str:
        packed = ", packed" if self.packed is not None else ""
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden}, "
            f"intermediate={self.intermediate}{packed}"
        )
