"""CPU kernels in C (``cpu_kernels.c``, which includes ``cpu_kernels_simd.h``,
``cpu_kernels_attention.c`` and ``cpu_kernels_layers.c``): paged attention straight from the
block-paged KV cache (per token for decodes, tiled for prefills and extends), attention over a
shared prefix (cascade) merged into its rows' results, the K/V store, one-pass RMSNorm, RoPE and
SwiGLU (each for fp32 and for bf16 tensors), and the sampler's hashed noise and temperature-only
draw (fp32).

int8 KV cache (``kv_cache_dtype: int8``): the store quantizes each (token, KV head) row with its
own fp32 scale (``kernels.reference.quantize_kv_ref``'s rule, bit for bit) into int8 caches and
scale tensors; attention (fp32 or bf16 q) reads one byte per element, widening the integers in
registers and applying each scale once per (token, head).

bf16 tensors: attention reads bf16 K/V in place and computes in fp32 (AVX512-BF16 dot products
for q.k where the compiler targets them, a portable conversion otherwise;
``load(avx512bf16=False)`` builds without them), rounding its output once; the
elementwise kernels follow batchgen's PyTorch bf16 layers (see the C file).

The pure-PyTorch path has to copy every sequence's keys and values out of the paged cache into
contiguous buffers before ``scaled_dot_product_attention`` can read them: on decode steps that
copy (and the second read it causes) is most of the attention time. The C kernel reads the blocks
in place. The elementwise kernels replace chains of torch ops that each make a pass over memory.
The library is compiled on first use with the system C compiler into a per-user cache folder and
called through ctypes; when no compiler is found :func:`load` returns None and callers keep the
PyTorch path. Whether to use them at all (``BATCHGEN_CPU_KERNEL=0``) and which variant is chosen
once per engine, by :func:`batchgen.engine.backends.choose_backends`.
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
from pathlib import Path

import torch
from torch import Tensor

from batchgen.model.cpu_features import avx2_only, bf16_support
from batchgen.model.once import Once

__all__ = ["CpuKernels", "build", "for_dtype", "load"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_kernels.c")
# the files of its one translation unit (cpu_kernels.c includes the others): all in the cache key
_SOURCES = (
    _SOURCE,
    _SOURCE.with_name("cpu_kernels_simd.h"),
    _SOURCE.with_name("cpu_kernels_attention.c"),
    _SOURCE.with_name("cpu_kernels_layers.c"),
    _SOURCE.with_name("cpu_kernels_moe.c"),
    _SOURCE.with_name("cpu_kernels_gemm.c"),
)
# -fopenmp: the library needs libgomp.so.1, which resolves to the copy torch has already loaded,
# so the kernel's threads are torch's intra-op pool (see the C file)
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
# the portable bf16 build: bf16 converted by shifts, no AVX512-BF16 instructions
_NO_AVX512BF16 = ["-mno-avx512bf16"]
# the attention tiles' q.k on AVX512-BF16 dot products (where the build has them): on CPUs
# without AMX, where they are faster than fp32 FMAs (AMD EPYC: the tiled kernel 1.24x faster than
# the portable build, scripts/bench_cpu_kernels.py --bf16-only); on AMX CPUs they measured slower
_TILE_DPBF16 = ["-DBATCHGEN_TILE_DPBF16"]
# the AVX2 cap (cpu_features.avx2_only): no AVX-512 of any kind (GCC drops every AVX-512 subset
# with avx512f), so the kernels take their 8-lane AVX2 paths
_NO_AVX512 = ["-mno-avx512f"]
_DTYPES = (torch.float32, torch.bfloat16)
# (cache dtype, compute dtype) pairs the kernels serve
_KV_DTYPES = frozenset(
    {
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.int8, torch.float32),
        (torch.int8, torch.bfloat16),
    }
)


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


def _compile(cc: str, flags: list[str] = _FLAGS) -> Path:
    """Build the shared library unless a matching one is cached; returns its path."""
    source = b"\0".join(path.read_bytes() for path in _SOURCES)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        b"\0".join(
            s.encode() if isinstance(s, str) else s
            for s in (source, " ".join(flags), version, platform.machine(), _cpu_signature())
        )
    ).hexdigest()[:16]
    folder = _cache_dir()
    target = folder / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent processes never load a half-written file
    fd, tmp = tempfile.mkstemp(prefix=".cpu_kernels-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *flags, str(_SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _bind(fn: ctypes._CFuncPtr, restype: type | None, *argtypes: type) -> ctypes._CFuncPtr:
    """``fn`` with its ctypes signature set."""
    fn.argtypes = list(argtypes)
    fn.restype = restype
    return fn


def _scales_ok(
    k_cache: Tensor, v_cache: Tensor, k_scale: Tensor | None, v_scale: Tensor | None
) -> bool:
    """Whether the caches and scales form a valid pair: int8 caches with contiguous fp32 scales
    ``[num_blocks, block_size, Hkv]``, or float caches without scales."""
    if k_cache.dtype != torch.int8:
        return k_scale is None and v_scale is None
    return (
        v_cache.dtype == torch.int8
        and k_scale is not None
        and v_scale is not None
        and all(
            s.dtype == torch.float32 and s.is_contiguous() and s.shape == k_cache.shape[:3]
            for s in (k_scale, v_scale)
        )
    )


class CpuKernels:
    """ctypes bindings of the C functions (see the C file for their exact semantics). Each method
    checks dtypes, shapes and strides (not the index values inside its tensors: those come from
    the engine) and raises ValueError rather than pass a mislaid pointer. Layer and attention
    methods take fp32 or bf16 tensors (one dtype per call; lse is always fp32)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        self._attention = _bind(lib.paged_attention_f32, ctypes.c_int, p, i64, p, p, p, i64, p,
                                p, p, p, i32, p, p, i32, i32, i32, i32, f32, i32, f32, i32, i32)  # fmt: skip
        self._attention_bf16 = _bind(lib.paged_attention_bf16, ctypes.c_int, p, i64, p, p, p, i64,
                                     p, p, p, p, i32, p, i32, p, i32, i32, i32, i32, f32, i32,
                                     f32, i32, i32)  # fmt: skip
        self._store = {
            dt: _bind(getattr(lib, f"store_kv_{sfx}"), None, p, i64, p, i64, p, p, p, i64, i64)
            for dt, sfx in _SUFFIX.items()
        }
        self._rms_norm = {
            dt: _bind(getattr(lib, f"rms_norm_{sfx}"), None, p, i64, p, p, i64, i64, f32)
            for dt, sfx in _SUFFIX.items()
        }
        self._rope = {
            dt: _bind(getattr(lib, f"rope_{sfx}"), None, p, i64, p, p, i64, i64, i64)
            for dt, sfx in _SUFFIX.items()
        }
        self._silu_mul = {
            dt: _bind(getattr(lib, f"silu_mul_{sfx}"), None, p, i64, i64)
            for dt, sfx in _SUFFIX.items()
        }
        prefix_args = (p, i64, p, p, p, p, p, p, i32, p, p, i32, i32, i32, f32, i32)
        self._prefix = {
            dt: _bind(getattr(lib, f"prefix_attention_merge_{sfx}"), ctypes.c_int, *prefix_args)
            for dt, sfx in _SUFFIX.items()
        }
        self._attention_i8 = _bind(lib.paged_attention_i8, ctypes.c_int, p, i64, i32, p, p, p, p,
                                   p, i64, p, p, p, p, i32, p, i32, p, i32, i32, i32, i32, f32,
                                   i32, f32, i32, i32)  # fmt: skip
        self._store_i8 = _bind(lib.store_kv_i8, None, p, i64, p, i64, i32, p, p, p, p, p, i64, i32,
                               i32)  # fmt: skip
        self._prefix_i8 = _bind(lib.prefix_attention_merge_i8, ctypes.c_int, p, i64, i32, p, p, p,
                                p, p, p, p, p, i32, p, p, i32, i32, i32, f32, i32)  # fmt: skip
        self._moe = {
            dt: _bind(getattr(lib, f"moe_experts_{sfx}"), ctypes.c_int, p, i64, p, p, p, p, p, p,
                      i64, i64, i64, i64, i32)  # fmt: skip
            for dt, sfx in _SUFFIX.items()
        }
        self._combine = {
            dt: _bind(getattr(lib, f"moe_combine_{sfx}"), None, p, p, p, p, i64, i64, i64, i32)
            for dt, sfx in _SUFFIX.items()
        }
        self._noise = _bind(lib.uniform_noise_f32, None, p, p, i64, p, i64, i64)
        self._race = _bind(lib.race_draw_f32, None, p, i64, p, p, i64, i64, p)
        self._gemm = {
            dt: _bind(getattr(lib, name), ctypes.c_int, p, i64, i64, i64, p, i64, p, p, i64, p,
                      i64, i32)  # fmt: skip
            for dt, name in ((torch.bfloat16, "gemm_bf16_dpbf16"), (torch.float32, "gemm_f32"))
        }
        self.path = path
        # whether the build has the bf16 GEMM of batchgen.model.kernel_linear
        self.gemm_dpbf16 = bool(_bind(lib.cpu_kernels_gemm_dpbf16, ctypes.c_int)())
        # whether the build has the fp32 GEMM of batchgen.model.kernel_linear (AVX2 or AVX-512)
        self.gemm_f32 = bool(_bind(lib.cpu_kernels_gemm_f32, ctypes.c_int)())
        # whether bf16 attention uses the AVX512-BF16 dot products (else the portable path)
        self.avx512bf16 = bool(_bind(lib.cpu_kernels_avx512bf16, ctypes.c_int)())
        # the fp32 lanes of the attention tiles' vectors: 16 (AVX-512 builds) or 8 (AVX2)
        self.lanes = int(_bind(lib.cpu_kernels_lanes, ctypes.c_int)())

    def supports_kv_dtype(self, cache_dtype: torch.dtype, compute_dtype: torch.dtype) -> bool:
        """Whether attention and the store serve a KV cache of ``cache_dtype`` with q, k, v (and
        the model) in ``compute_dtype``: fp32/fp32, bf16/bf16, int8/fp32 and int8/bf16."""
        return (cache_dtype, compute_dtype) in _KV_DTYPES

    def prefix_attention_merge_(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        slots: Tensor,
        slot_offsets: Tensor,
        rows: Tensor,
        row_offsets: Tensor,
        out: Tensor,
        lse: Tensor,
        scale: float,
        k_scale: Tensor | None = None,
        v_scale: Tensor | None = None,
    ) -> None:
        """Attend shared prefixes and merge into their rows of ``out`` and ``lse`` in place (see
        ``prefix_attention_merge_f32``). Prefix c: cache slots ``slots[slot_offsets[c] :
        slot_offsets[c + 1]]``, q rows ``rows[row_offsets[c] : row_offsets[c + 1]]``; a row
        belongs to one prefix at most. q ``[T, Hq, D]`` with each row's heads contiguous; caches
        ``[num_blocks, block_size, Hkv, D]``; q and caches fp32 or bf16; out ``[T, Hq, D]`` and
        lse ``[T, Hq]`` contiguous fp32 (also for bf16 q: the caller rounds out once, after the
        last merge); indices int64, contiguous. int8 caches (fp32 or bf16 q): with their scales
        ``[num_blocks, block_size, Hkv]`` fp32 contiguous (see :meth:`store_kv`)."""
        t, hq, d = q.shape
        hkv = k_cache.shape[2]
        c = slot_offsets.numel() - 1
        i8 = k_cache.dtype == torch.int8
        if not (
            q.dtype in _DTYPES
            and (i8 or q.dtype == k_cache.dtype == v_cache.dtype)
            and _scales_ok(k_cache, v_cache, k_scale, v_scale)
            and out.dtype == lse.dtype == torch.float32
            and q.stride(2) == 1
            and q.stride(1) == d
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and v_cache.shape == k_cache.shape
            and k_cache.shape[3] == d
            and hq % hkv == 0
            and out.shape == q.shape
            and out.is_contiguous()
            and lse.shape == (t, hq)
            and lse.is_contiguous()
            and all(
                x.dtype == torch.int64 and x.is_contiguous()
                for x in (slots, slot_offsets, rows, row_offsets)
            )
            and row_offsets.numel() == c + 1
        ):
            raise ValueError("cpu prefix attention: unsupported dtypes, shapes or strides")
        if i8:
            assert k_scale is not None and v_scale is not None
            rc = self._prefix_i8(q.data_ptr(), q.stride(0), int(q.dtype == torch.bfloat16),
                                 k_cache.data_ptr(), v_cache.data_ptr(), k_scale.data_ptr(),
                                 v_scale.data_ptr(), slots.data_ptr(), slot_offsets.data_ptr(),
                                 rows.data_ptr(), row_offsets.data_ptr(), c, out.data_ptr(),
                                 lse.data_ptr(), hq, hkv, d, scale,
                                 torch.get_num_threads())  # fmt: skip
        else:
            rc = self._prefix[q.dtype](q.data_ptr(), q.stride(0), k_cache.data_ptr(),
                                       v_cache.data_ptr(), slots.data_ptr(),
                                       slot_offsets.data_ptr(), rows.data_ptr(),
                                       row_offsets.data_ptr(), c, out.data_ptr(), lse.data_ptr(),
                                       hq, hkv, d, scale, torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise MemoryError("cpu prefix attention: out of memory for its buffers")

    def uniform_noise(self, state: Tensor, ids: Tensor | None, k: int) -> Tensor:
        """The sampler's hashed uniforms (see ``uniform_noise_f32``): state ``[S]`` int64 row
        states; ids ``[S, k]`` or ``[1, k]`` int64 with contiguous rows, or None for 0..k-1
        -> ``[S, k]`` float32, bit-identical to the PyTorch formula in batchgen.engine.sampler."""
        (num_rows,) = state.shape
        if not (
            state.dtype == torch.int64
            and state.is_contiguous()
            and state.device.type == "cpu"
            and (
                ids is None
                or (
                    ids.dtype == torch.int64
                    and ids.dim() == 2
                    and ids.shape[1] == k
                    and ids.shape[0] in (1, num_rows)
                    and ids.stride(1) == 1
                )
            )
        ):
            raise ValueError("cpu uniform_noise: unsupported dtypes, shapes or strides")
        out = torch.empty(num_rows, k, dtype=torch.float32)
        stride = 0 if ids is None or ids.shape[0] == 1 else ids.stride(0)
        self._noise(state.data_ptr(), None if ids is None else ids.data_ptr(), stride,
                    out.data_ptr(), num_rows, k)  # fmt: skip
        return out

    def race_draw(self, logits: Tensor, temperature: Tensor, state: Tensor) -> Tensor:
        """The sampler's temperature-only draw (see ``race_draw_f32``): logits ``[S, V]`` fp32
        with contiguous rows, temperature ``[S]`` fp32 (> 0), state ``[S]`` int64 row states
        -> ``[S]`` int64 tokens."""
        if not (
            logits.dtype == torch.float32
            and logits.dim() == 2
            and logits.stride(1) == 1
            and logits.device.type == "cpu"
            and temperature.dtype == torch.float32
            and state.dtype == torch.int64
            and temperature.shape == state.shape == logits.shape[:1]
            and temperature.is_contiguous()
            and state.is_contiguous()
        ):
            raise ValueError("cpu race_draw: unsupported dtypes, shapes or strides")
        num_rows, vocab = logits.shape
        tokens = torch.empty(num_rows, dtype=torch.int64)
        self._race(logits.data_ptr(), logits.stride(0), temperature.data_ptr(), state.data_ptr(),
                   num_rows, vocab, tokens.data_ptr())  # fmt: skip
        return tokens

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim: x ``[..., n]`` fp32 or bf16
        whose rows are contiguous (any row stride for 2-D x), weight ``[n]`` of x's dtype -> new
        contiguous tensor. bf16: ``bf16(weight * bf16(x * inv))``, inv in fp32 (RMSNorm's HF
        formula)."""
        n = x.shape[-1]
        x2 = x if x.dim() == 2 else x.reshape(-1, n)
        if not (
            x.dtype in _DTYPES
            and x.dtype == weight.dtype
            and x2.stride(-1) == 1
            and weight.is_contiguous()
            and weight.numel() == n
        ):
            raise ValueError("cpu rms_norm: unsupported dtypes, shapes or strides")
        y = torch.empty(x.shape, dtype=x.dtype)
        self._rms_norm[x.dtype](x2.data_ptr(), x2.stride(0), weight.data_ptr(), y.data_ptr(),
                                x2.shape[0], n, eps)  # fmt: skip
        return y

    def rope_(self, x: Tensor, cos: Tensor, sin: Tensor) -> None:
        """Rotate-half RoPE in place: x ``[T, H, D]`` fp32 or bf16 with each row's heads
        contiguous (a column slice of qkv is fine); cos/sin ``[T, D/2]`` contiguous, x's dtype.
        bf16: bit for bit :func:`batchgen.model.layers.rotary.rope_` on bf16 tensors."""
        t, h, d = x.shape
        if not (
            x.dtype in _DTYPES
            and x.dtype == cos.dtype == sin.dtype
            and x.stride(2) == 1
            and x.stride(1) == d
            and d % 2 == 0
            and cos.is_contiguous()
            and sin.is_contiguous()
            and cos.shape == sin.shape == (t, d // 2)
        ):
            raise ValueError("cpu rope: unsupported dtypes, shapes or strides")
        self._rope[x.dtype](x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), t, h, d)

    def silu_mul_(self, gate_up: Tensor) -> Tensor:
        """SwiGLU in place: the first half of gate_up ``[T, 2I]`` (contiguous fp32 or bf16)
        becomes ``silu(gate) * up``; returns that half, a ``[T, I]`` view with row stride 2I.
        bf16: ``bf16(bf16(silu(gate)) * up)``, silu in fp32, as the PyTorch ops round."""
        t, two_i = gate_up.shape
        if not (gate_up.dtype in _DTYPES and gate_up.is_contiguous() and two_i % 2 == 0):
            raise ValueError("cpu silu_mul: unsupported dtypes, shapes or strides")
        self._silu_mul[gate_up.dtype](gate_up.data_ptr(), t, two_i // 2)
        return gate_up[:, : two_i // 2]

    def moe_experts(
        self,
        x: Tensor,
        rows: Tensor,
        starts: Tensor,
        gate_up: Tensor,
        down: Tensor,
        out: Tensor,
        max_rows: int,
    ) -> None:
        """The experts' SwiGLU MLPs over (token, slot) pairs sorted by expert: x ``[T, H]``
        (rows contiguous), rows ``[P]`` int64 (pair p's token row), starts ``[E + 1]`` int64
        (expert e's pairs are ``starts[e]:starts[e + 1]``), gate_up ``[E, 2I, H]``, down
        ``[E, H, I]`` -> out ``[P, H]`` (contiguous, x's dtype, in the pairs' sorted order): the
        rows of the experts with at most ``max_rows`` pairs (other rows are left as they are).
        bf16 rounds where the PyTorch path's tensors are stored."""
        e, two_i, h = gate_up.shape
        p = rows.shape[0]
        ok = (
            x.dtype in _DTYPES
            and gate_up.dtype == down.dtype == out.dtype == x.dtype
            and x.dim() == 2
            and x.shape[1] == h
            and x.stride(1) == 1
            and gate_up.is_contiguous()
            and down.is_contiguous()
            and down.shape == (e, h, two_i // 2)
            and rows.dtype == starts.dtype == torch.int64
            and rows.is_contiguous()
            and starts.is_contiguous()
            and starts.shape == (e + 1,)
            and out.is_contiguous()
            and out.shape == (p, h)
        )
        if not ok:
            raise ValueError("cpu moe_experts: unsupported dtypes, shapes or strides")
        act = torch.empty(p, two_i // 2, dtype=x.dtype)
        rc = self._moe[x.dtype](x.data_ptr(), x.stride(0), rows.data_ptr(), starts.data_ptr(),
                                gate_up.data_ptr(), down.data_ptr(), act.data_ptr(),
                                out.data_ptr(), e, h, two_i // 2, max_rows,
                                torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise MemoryError("cpu moe_experts: out of memory for its task list")

    def moe_combine(self, y: Tensor, pos: Tensor, weights: Tensor) -> Tensor:
        """Each token's weighted sum of its experts' outputs, read where they lie: y ``[P, H]``
        (contiguous fp32 or bf16, the experts' output rows in any order), pos ``[T * k]`` int64
        (pair ``(t, j)``'s row of y), weights ``[T, k]`` fp32 -> ``[T, H]`` fp32, summed in slot
        order like :func:`batchgen.model.layers.moe.combine`."""
        t, k = weights.shape
        h = y.shape[1]
        ok = (
            y.dtype in _DTYPES
            and y.dim() == 2
            and y.is_contiguous()
            and pos.dtype == torch.int64
            and pos.shape == (t * k,)
            and pos.is_contiguous()
            and weights.dtype == torch.float32
            and weights.is_contiguous()
        )
        if not ok:
            raise ValueError("cpu moe_combine: unsupported dtypes, shapes or strides")
        out = torch.empty(t, h, dtype=torch.float32)
        self._combine[y.dtype](y.data_ptr(), pos.data_ptr(), weights.data_ptr(), out.data_ptr(),
                               t, k, h, torch.get_num_threads())  # fmt: skip
        return out

    def gemm(
        self,
        h: Tensor,
        packed: Tensor,
        out_features: int,
        bias: Tensor | None,
        add: Tensor | None,
        out: Tensor,
    ) -> Tensor:
        """``out = h @ W^T + bias + add``, returns out: h ``[M, K]`` bf16 or fp32 (unit column
        stride), packed W ``[N, K]`` in :func:`batchgen.model.kernel_linear.pack`'s layout for
        h's dtype (bf16 ``[ceil(N/16), ceil(K/2), 16, 2]``, fp32 ``[ceil(N/16), K, 16]``), bias
        ``[N]`` contiguous or None, add and out ``[M, N]`` with unit column stride (add may be
        out itself), all in h's dtype; bf16 outputs are rounded once. bf16 only where
        :attr:`gemm_dpbf16`, fp32 where :attr:`gemm_f32`."""
        m, k = h.shape
        n, dt = out_features, h.dtype
        bf16 = dt == torch.bfloat16
        layout = ((n + 15) // 16, (k + 1) // 2, 16, 2) if bf16 else ((n + 15) // 16, k, 16)
        ok = (
            (self.gemm_dpbf16 if bf16 else self.gemm_f32 and dt == torch.float32)
            and packed.dtype == out.dtype == dt
            and h.stride(1) == 1
            and packed.is_contiguous()
            and packed.shape == layout
            and out.shape == (m, n)
            and out.stride(1) == 1
            and (bias is None or (bias.dtype == dt and bias.is_contiguous()
                                  and bias.shape == (n,)))
            and (add is None or (add.dtype == dt and add.shape == (m, n)
                                 and add.stride(1) == 1))
        )  # fmt: skip
        if not ok:
            raise ValueError("cpu gemm: unsupported dtypes, shapes or strides")
        self._gemm[dt](h.data_ptr(), h.stride(0), m, k, packed.data_ptr(), n,
                       None if bias is None else bias.data_ptr(),
                       None if add is None else add.data_ptr(),
                       0 if add is None else add.stride(0), out.data_ptr(), out.stride(0),
                       torch.get_num_threads())  # fmt: skip
        return out

    def store_kv(
        self,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        slot_mapping: Tensor,
        k_scale: Tensor | None = None,
        v_scale: Tensor | None = None,
    ) -> None:
        """``cache[slot_mapping[t]] = k[t]`` (and v): k/v ``[T, Hkv, D]`` with each row's heads
        contiguous; caches ``[num_blocks, block_size, Hkv, D]`` contiguous; all fp32 or all
        bf16; slot_mapping ``[T]`` int64 (negative slots are skipped).

        int8 caches: k/v fp32 or bf16, each (token, KV head) row quantized with its own scale
        into the caches and k_scale/v_scale ``[num_blocks, block_size, Hkv]`` (fp32, contiguous),
        bit for bit ``kernels.reference.quantize_kv_ref``."""
        t, hkv, d = k.shape
        i8 = k_cache.dtype == torch.int8
        if not (
            k.dtype in _DTYPES
            and k.dtype == v.dtype
            and (i8 or k.dtype == k_cache.dtype == v_cache.dtype)
            and _scales_ok(k_cache, v_cache, k_scale, v_scale)
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
        if i8:
            assert k_scale is not None and v_scale is not None
            self._store_i8(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                           int(k.dtype == torch.bfloat16), k_cache.data_ptr(), v_cache.data_ptr(),
                           k_scale.data_ptr(), v_scale.data_ptr(), slot_mapping.data_ptr(), t,
                           hkv, d)  # fmt: skip
            return
        self._store[k.dtype](
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

    def paged_attention(
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
        tiled: bool = False,
        k_scale: Tensor | None = None,
        v_scale: Tensor | None = None,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        """Attention of the sequences ``seqs`` ``[m]`` int32, written into their rows of ``out``.
        ``window``: a sliding window W, the row at position p sees keys ``p-W+1 .. p`` only
        (and none before ``k_start``); None: every key up to p. ``softcap``: each score s
        becomes ``softcap * tanh(s / softcap)`` before the softmax (None: as it is).

        ``tiled``: the 16-row tiled variant, faster on runs of new tokens (prefills, extends);
        else the per-token one, for decodes.

        q ``[T, Hq, D]`` with each row's heads contiguous (a column slice of the fused qkv
        output is fine); caches ``[num_blocks, block_size, Hkv, D]`` contiguous; q and caches
        fp32, or bf16 (K/V converted to fp32 as they are read, fp32 sums);
        block_tables ``[B, max_blocks]``, cu_seqlens_q ``[B+1]``, seq_lens ``[B]``, k_start
        ``[B]`` (first key each sequence attends to; None = 0): int32, contiguous;
        out ``[T, Hq, D]`` contiguous, q's dtype or fp32 (bf16 q: rounded once into bf16, or
        kept in fp32 for a merge to follow); lse ``[T, Hq]`` (optional): contiguous fp32.

        int8 caches (q fp32 or bf16): with their scales k_scale/v_scale ``[num_blocks,
        block_size, Hkv]`` fp32 contiguous (see :meth:`store_kv`); the result is attention over
        the dequantized cache (``q * scale`` in fp32) up to fp32 rounding.
        """
        t, hq, d = q.shape
        num_blocks, block_size, hkv, dk = k_cache.shape
        i8 = k_cache.dtype == torch.int8
        if not (
            q.dtype in _DTYPES
            and (i8 or q.dtype == k_cache.dtype == v_cache.dtype)
            and _scales_ok(k_cache, v_cache, k_scale, v_scale)
            and out.dtype in (q.dtype, torch.float32)
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
        if i8:
            assert k_scale is not None and v_scale is not None
            head: tuple[int, ...] = (
                q.data_ptr(),
                q.stride(0),
                int(q.dtype == torch.bfloat16),
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                k_scale.data_ptr(),
                v_scale.data_ptr(),
            )
        else:
            head = (q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr())
        common = (
            *head,
            block_tables.data_ptr(),
            block_tables.stride(0),
            cu_seqlens_q.data_ptr(),
            seq_lens.data_ptr(),
            None if k_start is None else k_start.data_ptr(),
            seqs.data_ptr(),
            seqs.numel(),
            out.data_ptr(),
        )
        if i8:
            out_bf16: tuple[int, ...] = (int(out.dtype == torch.bfloat16),)
            fn = self._attention_i8
        elif q.dtype == torch.bfloat16:
            out_bf16 = (int(out.dtype == torch.bfloat16),)
            fn = self._attention_bf16
        else:
            out_bf16, fn = (), self._attention
        rc = fn(
            *common,
            *out_bf16,
            None if lse is None else lse.data_ptr(),
            hq,
            hkv,
            d,
            block_size,
            scale,
            window or 0,
            softcap or 0.0,
            int(tiled),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("cpu paged attention: out of memory for its scratch buffers")


def build(avx512bf16: bool = True) -> CpuKernels | None:
    """Compile (or find cached) and load a library; None when no compiler is found or the build
    fails (logged). ``avx512bf16=False``: the portable bf16 code even where the CPU has the
    AVX512-BF16 instructions (the fp32 kernels are the same in both builds). Under the AVX2 cap
    (``cpu_features.avx2_only``) both variants are built without AVX-512."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: the CPU path uses slower PyTorch ops")
        return None
    flags = _FLAGS if avx512bf16 else _FLAGS + _NO_AVX512BF16
    if avx2_only():
        flags = flags + _NO_AVX512
    elif "AMX-BF16" not in bf16_support().features:
        flags = flags + _TILE_DPBF16
    try:
        return CpuKernels(_compile(cc, flags))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("could not build the CPU kernels (%s): using PyTorch ops", e)
        return None


# the process's kernels, per variant (avx512bf16 or portable): built by the first caller, every
# concurrent caller waits for them
_KERNELS: dict[bool, Once[CpuKernels | None]] = {
    variant: Once(lambda variant=variant: build(variant)) for variant in (True, False)
}


def load(avx512bf16: bool = True) -> CpuKernels | None:
    """The compiled kernels, or None when they cannot be built here (logged once); with
    ``avx512bf16=False`` the portable bf16 code. Built and loaded at the first call (callers
    arriving meanwhile wait for it); later calls return the same object."""
    return _KERNELS[avx512bf16].get()


def for_dtype(
    device: torch.device, dtype: torch.dtype, avx512bf16: bool = True
) -> CpuKernels | None:
    """The kernels for tensors of this device and dtype: CPU fp32 and bf16 only, and only when
    they could be built; None means the caller's PyTorch path."""
    if device.type == "cpu" and dtype in _DTYPES:
        return load(avx512bf16)
    return None
