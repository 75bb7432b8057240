"""Triton kernels: the paged KV cache (store, attention, block copy), mixture-of-experts expert
compute (``fused_moe``) and the sampler's draw (``sampler``, imported by its module).

Importing this package imports no Triton: the module of each function listed in ``_HOME`` is
imported, with Triton, at the first access to the function here
(``batchgen.kernels.paged_attention``), so the torch path runs where Triton is not installed.
``warmup`` compiles the attention variants an engine launches.
``batchgen.kernels.reference`` holds the plain PyTorch twin of each kernel (torch only).

Set ``TRITON_INTERPRET=1`` before the first access to run the kernels on CPU tensors with
Triton's interpreter (tests do this when no GPU is present).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["choose_num_splits", "copy_blocks", "fused_moe", "paged_attention", "store_kv"]

# exported name -> the submodule that defines it (names differ from module names, so a
# submodule imported directly never shadows a function here)
_HOME = {
    "choose_num_splits": "attention",
    "copy_blocks": "block_copy",
    "fused_moe": "moe",
    "paged_attention": "attention",
    "store_kv": "kv_store",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{home}", __name__), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
