"""The torch path's block copy (copy-on-write of a shared, partially filled KV-cache block).

The Triton backend uses the kernel ``batchgen.kernels.copy_blocks``; this is its PyTorch
counterpart, with the same signature, for the torch backend (it needs no Triton).
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["copy_blocks"]


def copy_blocks(kv_cache: Tensor, src: Tensor, dst: Tensor) -> None:
    """``kv_cache[:, :, dst[i]] = kv_cache[:, :, src[i]]`` for every i, in every layer, K and V.

    kv_cache ``[L, 2, num_blocks, block_size, Hkv, D]`` (or a quantized cache's scales
    ``[L, 2, num_blocks, block_size, Hkv]``); src, dst ``[P]`` int64 block ids on the
    cache's device. As for the kernel, destinations are distinct and none is a source (the
    engine copies into fresh blocks), so the copies are independent.
    """
    if src.numel():
        kv_cache.index_copy_(2, dst, kv_cache.index_select(2, src))
