"""Triton kernels for the paged KV cache: store, attention, block copy.

Set ``TRITON_INTERPRET=1`` before importing this package to run the kernels on CPU tensors with
Triton's interpreter (tests do this when no GPU is present). ``batchgen.kernels.reference`` holds
the plain PyTorch twin of each kernel.
"""

from .copy_blocks import copy_blocks
from .paged_attention import choose_num_splits, paged_attention
from .store_kv import store_kv

__all__ = ["choose_num_splits", "copy_blocks", "paged_attention", "store_kv"]
