"""Paged attention on CPUs straight from the block-paged KV cache (``cpu_attention.c``).

The pure-PyTorch path has to copy every sequence's keys and values out of the paged cache into
contiguous buffers before ``scaled_dot_product_attention`` can read them: on decode steps that
copy (and the second read it causes) is most of the attention time. This small C kernel reads the
blocks in place. It is compiled on first use with the system C compiler into a per-user cache
folder and called through ctypes; when no compiler is found, or ``BATCHGEN_CPU_KERNEL=0``,
:func:`load` returns None and the caller keeps the PyTorch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["CpuAttentionKernel", "load"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_attention.c")
# -fopenmp: the library needs libgomp.so.1, which resolves to the copy torch has already loaded,
# so the kernel's threads are torch's intra-op pool (see the C file)
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
_lock = threading.Lock()
_loaded: CpuAttentionKernel | None = None
_tried = False


def _cache_dir() -> Path:
    base = os.environ.get("BATCHGEN_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME")
    return Path(base) / "batchgen" if base else Path.home() / ".cache" / "batchgen"


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _compile(cc: str) -> Path:
    """Build the shared library unless a matching one is cached; returns its path."""
    source = _SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        b"\0".join(
            s.encode() if isinstance(s, str) else s
            for s in (source, " ".join(_FLAGS), version, platform.machine(), _cpu_signature())
        )
    ).hexdigest()[:16]
    folder = _cache_dir()
    target = folder / f"cpu_attention-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent processes never load a half-written file
    fd, tmp = tempfile.mkstemp(prefix=".cpu_attention-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class CpuAttentionKernel:
    """ctypes binding of ``paged_attention_f32`` (see the C file for the exact semantics)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        fn = lib.paged_attention_f32
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [p, i64, p, p, p, i64, p, p, p, p, i32, p, p, i32, i32, i32, i32,
                       ctypes.c_float, i32]  # fmt: skip
        fn.restype = ctypes.c_int
        self._fn = fn
        store = lib.store_kv_f32
        store.argtypes = [p, i64, p, i64, p, p, p, i64, i64]
        store.restype = None
        self._store = store
        self.path = path

    def store_kv(
        self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
    ) -> None:
        """``cache[slot_mapping[t]] = k[t]`` (and v): k/v ``[T, Hkv, D]`` fp32 with each row's
        heads contiguous; caches ``[num_blocks, block_size, Hkv, D]`` contiguous fp32;
        slot_mapping ``[T]`` int64 (negative slots are skipped)."""
        t, hkv, d = k.shape
        if not (
            k.dtype == v.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and v.shape == k.shape
            and k.stride(2) == v.stride(2) == 1
            and k.stride(1) == v.stride(1) == d
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and v_cache.shape == k_cache.shape
            and tuple(k_cache.shape[2:]) == (hkv, d)
            and slot_mapping.dtype == torch.int64
            and slot_mapping.is_contiguous()
            and slot_mapping.numel() == t
        ):
            raise ValueError("cpu store_kv: unsupported dtypes, shapes or strides")
        self._store(
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slot_mapping.data_ptr(),
            t,
            hkv * d,
        )

    def __call__(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_tables: Tensor,
        cu_seqlens_q: Tensor,
        seq_lens: Tensor,
        seqs: Tensor,
        out: Tensor,
        scale: float,
        k_start: Tensor | None = None,
        lse: Tensor | None = None,
    ) -> None:
        """Attention of the sequences ``seqs`` ``[m]`` int32, written into their rows of ``out``.

        q ``[T, Hq, D]`` fp32 with each row's heads contiguous (a column slice of the fused qkv
        output is fine); caches ``[num_blocks, block_size, Hkv, D]`` contiguous fp32;
        block_tables ``[B, max_blocks]``, cu_seqlens_q ``[B+1]``, seq_lens ``[B]``, k_start
        ``[B]`` (first key each sequence attends to; None = 0): int32, contiguous;
        out ``[T, Hq, D]`` and lse ``[T, Hq]`` (optional): contiguous fp32.
        """
        t, hq, d = q.shape
        num_blocks, block_size, hkv, dk = k_cache.shape
        if not (
            q.dtype == k_cache.dtype == v_cache.dtype == out.dtype == torch.float32
            and q.stride(2) == 1
            and q.stride(1) == d
            and dk == d
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and v_cache.shape == k_cache.shape
            and out.is_contiguous()
            and out.shape == q.shape
            and block_tables.dtype == torch.int32
            and block_tables.stride(1) == 1
            and all(
                x.dtype == torch.int32 and x.is_contiguous()
                for x in (cu_seqlens_q, seq_lens, seqs) + (() if k_start is None else (k_start,))
            )
            and (lse is None or (lse.dtype == torch.float32 and lse.is_contiguous()))
            and hq % hkv == 0
        ):
            raise ValueError("cpu paged attention: unsupported dtypes, shapes or strides")
        rc = self._fn(
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            cu_seqlens_q.data_ptr(),
            seq_lens.data_ptr(),
            None if k_start is None else k_start.data_ptr(),
            seqs.data_ptr(),
            seqs.numel(),
            out.data_ptr(),
            None if lse is None else lse.data_ptr(),
            hq,
            hkv,
            d,
            block_size,
            scale,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("cpu paged attention: out of memory for its scratch buffers")


def load() -> CpuAttentionKernel | None:
    """The compiled kernel, or None when disabled or when it cannot be built here (logged once)."""
    global _loaded, _tried
    with _lock:
        if _tried:
            return _loaded
        _tried = True
        if os.environ.get("BATCHGEN_CPU_KERNEL", "1") == "0":
            return None
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            log.warning("no C compiler found: CPU attention uses the slower PyTorch path")
            return None
        try:
            _loaded = CpuAttentionKernel(_compile(cc))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            log.warning("could not build the CPU attention kernel (%s): using PyTorch", e)
            _loaded = None
        return _loaded
