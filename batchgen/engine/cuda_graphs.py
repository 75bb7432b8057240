"""Decode-only steps replayed from CUDA graphs (``engine.cuda_graphs: on``), one graph per
bucketed batch size.

A decode-only step of ``B`` sequences runs the graph of the smallest bucket ``Bp >= B`` (powers
of two up to ``max_num_seqs``, and ``max_num_seqs`` itself). The step's tensors are copied into
static buffers; the ``Bp - B`` padding rows get slot -1 (``store_kv`` skips them), one key of
context and token 0, and their outputs are dropped. Attention is captured with ``max_seqlen_k``
= ``max_model_len``, which fixes each bucket's split-K count; the kernel divides the actual keys
among the splits at run time (splits past the keys are empty).

``capture=False`` runs the same padded static-buffer steps eagerly: how the padding is tested
without a GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from batchgen.engine.batch import StepTensors
from batchgen.model.attention import AttentionMetadata

__all__ = ["DecodeGraphs", "graph_buckets"]


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: powers of two below ``max_num_seqs``, then it."""
    buckets = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return [*buckets, max_num_seqs]


class DecodeGraphs:
    """Captured (or, with ``capture=False``, eager) decode steps over static buffers."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,
        *,
        kv_scales: torch.Tensor | None = None,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        # a quantized cache's scales, passed with it (None: a float cache)
        self.model_kwargs = {} if kv_scales is None else {"kv_scales": kv_scales}
        self.max_model_len = max_model_len
        self.capture = capture
        self.buckets = graph_buckets(max_num_seqs)
        top = self.buckets[-1]
        self.width = -(-max_model_len // block_size)
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(top, dtype=i64, device=device)
        self.positions = torch.zeros(top, dtype=i64, device=device)
        self.slots = torch.full((top,), -1, dtype=i64, device=device)
        self.block_tables = torch.zeros((top, self.width), dtype=i32, device=device)
        self.cu_seqlens = torch.arange(top + 1, dtype=i32, device=device)
        self.seq_lens = torch.ones(top, dtype=i32, device=device)
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}

    def _meta(self, bucket: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:bucket],
            block_tables=self.block_tables[:bucket],
            cu_seqlens_q=self.cu_seqlens[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            max_seqlen_q=1,
            max_seqlen_k=self.max_model_len,
            num_decodes=bucket,
        )

    def _forward(self, bucket: int) -> torch.Tensor:
        return self.model(
            self.input_ids[:bucket],
            self.positions[:bucket],
            self.kv_cache,
            self._meta(bucket),
            **self.model_kwargs,
        )

    def capture_all(self) -> None:
        """Capture every bucket's graph (largest first, sharing one memory pool); each bucket
        runs once eagerly first, so Triton has compiled before capture."""
        pool = None
        for bucket in reversed(self.buckets):
            with torch.inference_mode():
                self._forward(bucket)  # compile and allocate outside the capture
                torch.cuda.synchronize(self.input_ids.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(bucket)
            pool = graph.pool()
            self.graphs[bucket] = (graph, out)

    def supports(self, step: StepTensors) -> bool:
        """A decode-only step that fits the largest bucket and the static block tables."""
        meta = step.meta
        num = step.input_ids.shape[0]
        return (
            meta.max_seqlen_q == 1
            and meta.num_decodes == num == meta.seq_lens.shape[0]
            and num <= self.buckets[-1]
            and meta.block_tables.shape[1] <= self.width
        )

    def run(self, step: StepTensors) -> torch.Tensor:
        """Hidden states ``[B, hidden]`` of a supported step."""
        num = step.input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= num)
        meta = step.meta
        self.input_ids[:num].copy_(step.input_ids)
        self.positions[:num].copy_(step.positions)
        self.slots[:num].copy_(meta.slot_mapping)
        self.block_tables[:num, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.seq_lens[:num].copy_(meta.seq_lens)
        # Padding rows: no K/V write, one key of context (their block-table rows may be stale:
        # any block id there is a real block, and only its first slot is read).
        self.input_ids[num:bucket].zero_()
        self.positions[num:bucket].zero_()
        self.slots[num:bucket].fill_(-1)
        self.seq_lens[num:bucket].fill_(1)
        if not self.capture:
            return self._forward(bucket)[:num]
        graph, out = self.graphs[bucket]
        graph.replay()
        return out[:num]
