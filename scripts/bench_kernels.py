"""Benchmark the Triton kernels on a GPU against the memory-bandwidth limit.

    python scripts/bench_kernels.py --json bench-out/kernels.json     # GPU, a few minutes
    python scripts/bench_kernels.py --smoke                           # CPU interpreter, tiny
    python scripts/bench_kernels.py --compile-only                    # no GPU: sm_90 compiles

It runs from a checkout as it is (no ``pip install``: the kernels import nothing of batchgen, so
the checkout's ``kernels/`` package is imported directly); only torch and triton are needed.

Each case is first checked against the PyTorch reference (on a sample of its sequences), then
timed with ``triton.testing.do_bench``. Decode attention is bandwidth bound, so a case reports
the bytes it must move (every K/V byte of every sequence read once, plus q, out and block
tables) divided by its time, and that figure as a fraction of the device's copy bandwidth
(measured in the same run: a large tensor copy, read plus write bytes). Prefill also reports
TFLOP/s. The reference is timed only on small cases. Cases cover GQA 32:8 (Llama-3-8B) and 28:4
(Qwen2.5-7B, G = 7). Every cache slot no sequence uses, and the spare block that block-table
padding points at, hold NaN: a read the kernel should not make shows up as a non-finite output.

``--compile-only`` compiles every launch configuration for sm_90 (through ptxas, no GPU needed)
and prints registers and spills per kernel; the test suite runs it to catch code that the
interpreter accepts but the compiler rejects.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from itertools import accumulate
from pathlib import Path
from types import ModuleType

import torch

REPO = Path(__file__).resolve().parents[1]
# The checkout's kernels when run from one (as `kernels`), else the installed batchgen.kernels.
if (REPO / "kernels" / "__init__.py").is_file():
    sys.path.insert(0, str(REPO))
    KERNELS_PACKAGE = "kernels"
else:
    KERNELS_PACKAGE = "batchgen.kernels"

# Realistic Llama-3-8B-like attention shapes (the default; cases may set other head counts).
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
QWEN_HEADS = dict(num_heads=28, num_kv_heads=4)  # Qwen2.5-7B: G = 7
# Reference timing and full-batch reference checks only below this many cached tokens.
REF_MAX_TOKENS = 16_384
REF_SAMPLE_SEQS = 8

Timer = Callable[[Callable[[], object]], float]  # milliseconds per call of a thunk


def kernel_module(name: str = "") -> ModuleType:
    """The kernels package (``name`` empty) or one of its modules, e.g. ``attention``."""
    return importlib.import_module(KERNELS_PACKAGE + (f".{name}" if name else ""))


@dataclass
class Result:
    """One row of the table (and of the JSON)."""

    kernel: str
    case: str
    time_ms: float
    bytes: int
    gb_per_s: float
    frac_copy_bw: float
    num_splits: int | None = None
    tflops: float | None = None
    ref_ms: float | None = None
    speedup: float | None = None
    max_abs_err: float | None = None


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def make_timer(device: torch.device) -> Timer:
    """Milliseconds per call: do_bench on a GPU, a plain wall-clock loop on the CPU (smoke)."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: float(triton.testing.do_bench(fn, warmup=25, rep=100))

    def cpu_time(fn: Callable[[], object]) -> float:
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return cpu_time


def copy_bandwidth(device: torch.device, timer: Timer, smoke: bool) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    numel = (1 << 20) if smoke else (1 << 30)  # 2 GiB of bf16 on a GPU
    src = torch.empty(numel, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """One attention step over a randomly paged cache."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    q_lens: list[int]
    kv_lens: list[int]

    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.cu_seqlens_q,
            self.seq_lens,
            self.q.shape[-1] ** -0.5,
            max(self.q_lens),
            max(self.kv_lens),
        )

    @property
    def num_decodes(self) -> int:
        """Leading sequences with one query token (launched apart in a mixed step)."""
        return next((i for i, n in enumerate(self.q_lens) if n != 1), len(self.q_lens))

    def subset(self, seqs: list[int]) -> Batch:
        """The same step restricted to some sequences (for a cheaper reference check)."""
        q_starts = self.cu_seqlens_q.tolist()
        q = torch.cat([self.q[q_starts[b] : q_starts[b + 1]] for b in seqs])
        q_lens = [self.q_lens[b] for b in seqs]
        cu = torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=q.device)
        index = torch.tensor(seqs, device=q.device)
        return Batch(
            q,
            self.k_cache,
            self.v_cache,
            self.block_tables[index],
            cu,
            self.seq_lens[index],
            q_lens,
            [self.kv_lens[b] for b in seqs],
        )


def make_batch(
    q_lens: list[int],
    kv_lens: list[int],
    dtype: torch.dtype,
    device: torch.device,
    num_heads: int = NUM_HEADS,
    num_kv_heads: int = NUM_KV_HEADS,
    head_dim: int = HEAD_DIM,
    block_size: int = BLOCK_SIZE,
) -> Batch:
    """Random q and K/V; every sequence gets its own blocks from a random permutation. Slots
    past a sequence's length, and the spare block that table padding points at, are NaN."""
    blocks = [math.ceil(n / block_size) for n in kv_lens]
    num_blocks = sum(blocks) + 1
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    spare = perm[-1:]  # [1]: every padding entry of the table points here
    table = spare.repeat(len(kv_lens), max(blocks))  # [B, max_blocks]
    start = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[start : start + n]
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    nan = float("nan")
    k_cache[spare.long()] = nan
    v_cache[spare.long()] = nan
    tails = [(b, n % block_size) for b, n in enumerate(kv_lens) if n % block_size]
    if tails:
        last = torch.tensor([int(blocks[b]) - 1 for b, _ in tails], device=device)
        last_blocks = table[torch.tensor([b for b, _ in tails], device=device), last].long()
        filled = torch.tensor([f for _, f in tails], device=device)
        unused = torch.arange(block_size, device=device)[None, :] >= filled[:, None]  # [n, bs]
        k_tail, v_tail = k_cache[last_blocks], v_cache[last_blocks]  # [n, bs, Hkv, D]
        k_tail[unused] = nan
        v_tail[unused] = nan
        k_cache[last_blocks] = k_tail
        v_cache[last_blocks] = v_tail
    q = torch.randn(sum(q_lens), num_heads, head_dim, dtype=dtype, device=device)
    cu = torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=device)
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    return Batch(q, k_cache, v_cache, table, cu, seq_lens, list(q_lens), list(kv_lens))


def attention_bytes(batch: Batch) -> int:
    """Minimum bytes an attention step moves: K and V once per KV head, q, out, block tables."""
    kv_row = 2 * batch.k_cache.shape[2] * batch.k_cache.shape[3] * batch.k_cache.element_size()
    q_bytes = batch.q.numel() * batch.q.element_size()
    tables = sum(math.ceil(n / batch.k_cache.shape[1]) for n in batch.kv_lens) * 4
    return sum(batch.kv_lens) * kv_row + 2 * q_bytes + tables


def attention_flops(batch: Batch) -> int:
    """Multiply-adds x 2 of QK^T and PV over the causal (query, key) pairs."""
    num_heads, head_dim = batch.q.shape[1], batch.q.shape[2]
    pairs = 0
    for q_len, kv_len in zip(batch.q_lens, batch.kv_lens, strict=True):
        context = kv_len - q_len
        pairs += q_len * context + q_len * (q_len + 1) // 2
    return 4 * pairs * num_heads * head_dim


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


def check_attention(
    kernels: ModuleType, reference: ModuleType, batch: Batch, num_splits: int | None
) -> float:
    """Max abs error of the kernel vs the reference on (a sample of) the batch's sequences."""
    num_seqs = len(batch.kv_lens)
    if sum(batch.kv_lens) > REF_MAX_TOKENS and num_seqs > REF_SAMPLE_SEQS:
        step = num_seqs / REF_SAMPLE_SEQS
        batch = batch.subset(
            sorted({int(i * step) for i in range(REF_SAMPLE_SEQS)} | {num_seqs - 1})
        )
    actual = kernels.paged_attention(
        *batch.args(), num_splits=num_splits, num_decode_seqs=batch.num_decodes
    ).float()
    expected = reference.paged_attention_ref(*batch.args()).float()
    err = (actual - expected).abs().max().item()
    if not math.isfinite(err) or err > 5e-2:
        raise AssertionError(f"paged_attention disagrees with the reference: max abs error {err}")
    return err


def bench_attention(
    kernels: ModuleType,
    reference: ModuleType,
    timer: Timer,
    copy_bw: float,
    kind: str,
    q_lens: list[int],
    kv_lens: list[int],
    dtype: torch.dtype,
    device: torch.device,
    num_splits: int | None,
    **shape: int,
) -> Result:
    """Check one attention step against the reference, then time it."""
    batch = make_batch(q_lens, kv_lens, dtype, device, **shape)
    err = check_attention(kernels, reference, batch, num_splits)
    out = torch.empty_like(batch.q)
    ms = timer(
        lambda: kernels.paged_attention(
            *batch.args(), out=out, num_splits=num_splits, num_decode_seqs=batch.num_decodes
        )
    )
    nbytes = attention_bytes(batch)
    splits = num_splits
    if splits is None:  # report what the heuristic chose
        pa = kernel_module("attention")
        sm = pa._device_sm_count(device)
        splits = kernels.choose_num_splits(
            len(kv_lens), batch.k_cache.shape[2], max(q_lens), max(kv_lens), sm
        )
    ref_ms = speedup = None
    if sum(kv_lens) <= REF_MAX_TOKENS:
        ref_ms = timer(lambda: reference.paged_attention_ref(*batch.args()))
        speedup = ref_ms / ms
    b, lq, lk = len(kv_lens), max(q_lens), max(kv_lens)
    heads = f" {batch.q.shape[1]}:{batch.k_cache.shape[2]}"
    label = f"B={b} q={lq} kv={lk}{heads}" + ("" if num_splits is None else f" splits={num_splits}")
    return Result(
        kernel=f"attention/{kind}",
        case=label,
        time_ms=ms,
        bytes=nbytes,
        gb_per_s=nbytes / (ms * 1e-3) / 1e9,
        frac_copy_bw=nbytes / (ms * 1e-3) / copy_bw,
        num_splits=splits,
        tflops=attention_flops(batch) / (ms * 1e-3) / 1e12,
        ref_ms=ref_ms,
        speedup=speedup,
        max_abs_err=err,
    )


def bench_store_kv(
    kernels: ModuleType,
    reference: ModuleType,
    timer: Timer,
    copy_bw: float,
    num_tokens: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Result:
    num_blocks = math.ceil(num_tokens / BLOCK_SIZE) + 8
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.zeros(shape, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:num_tokens]
    kernels.store_kv(k, v, k_cache, v_cache, slots)
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    small = num_tokens <= 4096
    if small:
        reference.store_kv_ref(k, v, k_ref, v_ref, slots)
    else:  # the reference is a Python loop; check with one vectorised scatter instead
        k_ref.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = k
        v_ref.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = v
    if not (torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)):
        raise AssertionError("store_kv disagrees with the reference")
    ms = timer(lambda: kernels.store_kv(k, v, k_cache, v_cache, slots))
    nbytes = 2 * 2 * k.numel() * k.element_size() + slots.numel() * 8  # read k,v; write both
    ref_ms = timer(lambda: reference.store_kv_ref(k, v, k_ref, v_ref, slots)) if small else None
    return Result(
        kernel="store_kv",
        case=f"T={num_tokens}",
        time_ms=ms,
        bytes=nbytes,
        gb_per_s=nbytes / (ms * 1e-3) / 1e9,
        frac_copy_bw=nbytes / (ms * 1e-3) / copy_bw,
        ref_ms=ref_ms,
        speedup=None if ref_ms is None else ref_ms / ms,
        max_abs_err=0.0,
    )


def bench_copy_blocks(
    kernels: ModuleType,
    reference: ModuleType,
    timer: Timer,
    copy_bw: float,
    num_pairs: int,
    layers: int,
    dtype: torch.dtype,
    device: torch.device,
):
    num_blocks = 2 * num_pairs + 4
    shape = (layers, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    kv = torch.randn(shape, dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, device=device)
    src, dst = perm[:num_pairs], perm[num_pairs : 2 * num_pairs]
    expected = kv.clone()
    reference.copy_blocks_ref(expected, src, dst)
    kernels.copy_blocks(kv, src, dst)
    if not torch.equal(kv, expected):
        raise AssertionError("copy_blocks disagrees with the reference")
    ms = timer(lambda: kernels.copy_blocks(kv, src, dst))
    nbytes = 2 * layers * 2 * num_pairs * kv[0, 0, 0].numel() * kv.element_size()
    ref_ms = timer(lambda: reference.copy_blocks_ref(kv, src, dst))
    return Result(
        kernel="copy_blocks",
        case=f"P={num_pairs} L={layers}",
        time_ms=ms,
        bytes=nbytes,
        gb_per_s=nbytes / (ms * 1e-3) / 1e9,
        frac_copy_bw=nbytes / (ms * 1e-3) / copy_bw,
        ref_ms=ref_ms,
        speedup=ref_ms / ms,
        max_abs_err=0.0,
    )


def gpu_cases() -> list[dict]:
    """Attention cases for an H200-class GPU (about 3 minutes in total)."""
    cases: list[dict] = []
    for batch in (1, 8, 32, 128, 256):
        for context in (512, 2048, 8192, 32768):
            if batch * context > 4 * 1024 * 1024:  # keep each cache under about 16 GiB
                continue
            cases.append(
                dict(kind="decode", q_lens=[1] * batch, kv_lens=[context] * batch, num_splits=None)
            )
            if batch <= 8 and context >= 2048:  # what split-K buys
                cases.append(
                    dict(kind="decode", q_lens=[1] * batch, kv_lens=[context] * batch, num_splits=1)
                )
    # Ragged decode: lengths spread over 64..8192.
    ragged = [64 + (i * 8128) // 63 for i in range(64)]
    cases.append(dict(kind="decode", q_lens=[1] * 64, kv_lens=ragged, num_splits=None))
    for batch, q_len, context in (
        (1, 8192, 0),
        (4, 2048, 0),
        (16, 512, 0),
        (4, 512, 4096),
        (1, 2048, 30720),
    ):
        cases.append(
            dict(
                kind="prefill",
                q_lens=[q_len] * batch,
                kv_lens=[context + q_len] * batch,
                num_splits=None,
            )
        )
    # A mixed step: 64 decodes plus two prefill chunks, one over a cached prefix.
    mixed = dict(kind="mixed", q_lens=[1] * 64 + [1024, 1024], kv_lens=[2048] * 64 + [1024, 3072])
    cases.append(dict(**mixed, num_splits=None))
    # Qwen2.5-7B geometry (28:4, G = 7): decode at small and large batches, a mixed step.
    for batch, context in ((1, 8192), (8, 8192), (64, 2048), (256, 2048), (4, 32768)):
        cases.append(
            dict(
                kind="decode",
                q_lens=[1] * batch,
                kv_lens=[context] * batch,
                num_splits=None,
                **QWEN_HEADS,
            )
        )
    cases.append(dict(**mixed, num_splits=None, **QWEN_HEADS))
    return cases


def quick_cases() -> list[dict]:
    """A minute's subset of gpu_cases for scripts/gpu_check.sh: decode at 1..256 sequences and
    contexts up to 32k for both GQA geometries, with and without split-K, a prefill, mixed steps."""
    cases: list[dict] = []
    for heads in ({}, QWEN_HEADS):
        for batch, context in ((1, 32768), (8, 8192), (64, 2048), (256, 4096)):
            cases.append(dict(kind="decode", q_lens=[1] * batch, kv_lens=[context] * batch,
                              num_splits=None, **heads))  # fmt: skip
        cases.append(dict(kind="decode", q_lens=[1] * 8, kv_lens=[8192] * 8, num_splits=1,
                          **heads))  # fmt: skip
        cases.append(dict(kind="prefill", q_lens=[2048] * 2, kv_lens=[6144] * 2,
                          num_splits=None, **heads))  # fmt: skip
        cases.append(dict(kind="mixed", q_lens=[1] * 64 + [1024, 1024],
                          kv_lens=[2048] * 64 + [1024, 3072], num_splits=None, **heads))  # fmt: skip
    return cases


def smoke_cases() -> list[dict]:
    """Tiny cases for the interpreter (head_dim 64, 4:2 unless a case says otherwise)."""
    return [
        dict(kind="decode", q_lens=[1, 1], kv_lens=[40, 17], num_splits=None),
        dict(kind="decode", q_lens=[1, 1], kv_lens=[40, 17], num_splits=2),
        dict(kind="prefill", q_lens=[9, 5], kv_lens=[9, 21], num_splits=None),
        dict(kind="mixed", q_lens=[1, 1, 6], kv_lens=[33, 7, 20], num_splits=None,
             num_heads=7, num_kv_heads=1),
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------
# Compile-only check (no GPU)
# --------------------------------------------------------------------------------------------


def compile_only() -> int:
    """Compile each kernel's launch configurations for sm_90 and print registers and spills."""
    import subprocess
    import tempfile

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pa = kernel_module("attention")
    sk = kernel_module("kv_store")
    cb = kernel_module("block_copy")
    target = GPUTarget("cuda", 90, 32)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"

    def compile_like_jit(fn, pointers: dict, ints: dict, constexprs: dict, floats=(), **options):
        """Mimic the launcher's specialisation: ints equal to 1 become constants, pointers and
        ints divisible by 16 are marked so (vectorised loads depend on it)."""
        signature, attrs, constexprs = {}, {}, dict(constexprs)
        for i, name in enumerate(fn.arg_names):
            if name in constexprs:
                signature[name] = "constexpr"
            elif name in pointers:
                signature[name] = pointers[name]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif name in floats:
                signature[name] = "fp32"
            elif ints[name] == 1:
                signature[name] = "constexpr"
                constexprs[name] = 1
            else:
                signature[name] = "i32"
                if ints[name] % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        return triton.compile(
            ASTSource(fn, signature, constexprs, attrs), target=target, options=options
        )

    def usage(kernel) -> tuple[str, bool]:
        if not cuobjdump.exists():
            return "usage unknown (no cuobjdump)", False
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            text = subprocess.run(
                [str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True
            ).stdout
        line = next((ln.strip() for ln in text.splitlines() if ln.strip().startswith("REG:")), text)
        fields = dict(part.split(":", 1) for part in line.split() if ":" in part)
        spills = fields.get("STACK", "0") != "0" or fields.get("LOCAL", "0") != "0"
        return (
            f"REG:{fields.get('REG')} STACK:{fields.get('STACK')} LOCAL:{fields.get('LOCAL')}",
            spills,
        )

    tl_dtypes = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}
    any_spills = False
    failures = 0

    def report(name: str, build: Callable[[], object], known_spills: bool = False) -> None:
        """``known_spills``: a configuration known to spill (printed, not counted): fp32
        compute over a quantized cache, 255 registers and a stack on sm_90, not tuned."""
        nonlocal any_spills, failures
        start = time.perf_counter()
        try:
            kernel = build()
        except Exception as exc:  # report every failing configuration, then fail
            failures += 1
            print(f"FAIL  {name}: {type(exc).__name__}: {str(exc)[:400]}")
            return
        text, spills = usage(kernel)
        any_spills |= spills and not known_spills
        flag = ("  SPILLS (known)" if known_spills else "  SPILLS") if spills else ""
        print(f"ok    {name}: {text}{flag} ({time.perf_counter() - start:.1f}s)")

    # (dtype, G, D, max_seqlen_q, splits): each launch config, G at 1 / odd / power of two / wide.
    attention_variants = [
        ("bf16", 4, 128, 1, 1),
        ("bf16", 4, 128, 1, 4),
        ("bf16", 7, 128, 1, 64),
        ("bf16", 7, 128, 1024, 1),
        ("bf16", 4, 128, 17, 1),
        ("bf16", 4, 128, 512, 1),
        ("bf16", 1, 128, 1, 1),
        ("bf16", 1, 128, 512, 1),
        ("bf16", 3, 80, 1, 2),
        ("bf16", 3, 80, 512, 1),
        ("bf16", 32, 64, 1, 1),
        ("fp16", 8, 64, 17, 2),
        ("fp32", 4, 128, 1, 1),
        ("fp32", 4, 128, 512, 1),
        ("fp32", 32, 64, 1, 2),
        ("fp32", 3, 80, 17, 1),
        ("fp32", 64, 64, 1, 1),
        ("bf16", 64, 64, 1, 1),
        # quantized caches (6th: the cache's element type), dequantized in registers
        ("bf16", 4, 128, 1, 1, "i8"),
        ("bf16", 4, 128, 512, 1, "i8"),
        ("fp32", 4, 128, 1, 2, "i8"),  # known to spill (see report's `known`)
        ("bf16", 4, 128, 1, 1, "fp8e4nv"),
        ("bf16", 3, 80, 17, 1, "fp8e4nv"),
    ]
    for variant, (dtype, group, head_dim, max_q, splits, *kv) in enumerate(attention_variants):
        block_m, tile_n, num_warps, num_stages = pa._launch_config(max_q, group, dtype == "fp32")
        dot_dtype = tl_dtypes[dtype]
        ptr = "*" + dtype
        cache_ptr = "*" + (kv[0] if kv else dtype)
        pointers = dict(
            q_ptr=ptr,
            k_cache_ptr=cache_ptr,
            v_cache_ptr=cache_ptr,
            k_scale_ptr="*fp32",
            v_scale_ptr="*fp32",
            block_tables_ptr="*i32",
            cu_seqlens_q_ptr="*i32",
            seq_lens_ptr="*i32",
            out_ptr=ptr,
            part_out_ptr="*fp32",
            part_lse_ptr="*fp32",
            sinks_ptr="*fp32",
        )
        hkv, block_d = 8, triton.next_power_of_2(head_dim)
        hq = hkv * group
        ints = dict(
            num_seqs=1 if variant % 2 else 7,  # 1 becomes a constant in the launcher
            num_heads=hq,
            head_dim=head_dim,
            stride_qt=hq * head_dim,
            stride_qh=head_dim,
            stride_qd=1,
            stride_kb=BLOCK_SIZE * hkv * head_dim,
            stride_ks=hkv * head_dim,
            stride_kh=head_dim,
            stride_kd=1,
            stride_vb=BLOCK_SIZE * hkv * head_dim,
            stride_vs=hkv * head_dim,
            stride_vh=head_dim,
            stride_vd=1,
            stride_bt=64,
            stride_ot=hq * head_dim,
            stride_oh=head_dim,
            stride_od=1,
            stride_ksb=BLOCK_SIZE * hkv,
            stride_kss=hkv,
            stride_ksh=1,
            stride_vsb=BLOCK_SIZE * hkv,
            stride_vss=hkv,
            stride_vsh=1,
            window=128 if variant % 2 else 0,  # a sliding window (0: none), a run-time value
        )
        # every third variant caps its scores (Gemma 2), the next has sinks (gpt-oss: one pass)
        softcap, sinks = variant % 3 == 1, variant % 3 == 2 and splits == 1
        constexprs = dict(
            NUM_QUERIES_PER_KV=group,
            BLOCK_SIZE=BLOCK_SIZE,
            BLOCK_M=block_m,
            BLOCK_Q=1 if max_q == 1 else max(1, block_m // group),
            TILE_N=tile_n,
            BLOCK_D=block_d,
            NUM_SPLITS=splits,
            DOT_DTYPE=dot_dtype,
            DOT_PRECISION="ieee" if dtype == "fp32" else None,
            ONE_QUERY_PER_SEQ=max_q == 1,
            KV_QUANT=bool(kv),
            HAS_SOFTCAP=softcap,
            HAS_SINKS=sinks,
        )
        extras = "".join(
            f" {label}" for label, on in (("window", ints["window"]), ("softcap", softcap),
                                          ("sinks", sinks)) if on
        )  # fmt: skip
        name = (
            f"paged_attention {dtype}{' over ' + kv[0] if kv else ''} G={group} D={head_dim} max_q={max_q} splits={splits}{extras} "
            f"(M={block_m} N={tile_n} warps={num_warps} stages={num_stages})"
        )
        report(
            name,
            lambda p=pointers, i=ints, c=constexprs, w=num_warps, s=num_stages: compile_like_jit(
                pa._paged_attention_kernel, p, i, c, floats=("qk_scale", "softcap2"), num_warps=w,
                num_stages=s,
            ),
            known_spills=bool(kv) and dtype == "fp32",
        )
    report(
        "merge_splits bf16 S=64 D=128",
        lambda: compile_like_jit(
            pa._merge_splits_kernel,
            dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16"),
            dict(num_heads=28, head_dim=128, stride_ot=3584, stride_oh=128, stride_od=1),
            dict(NUM_SPLITS=64, BLOCK_S=64, BLOCK_D=128),
            num_warps=4,
        ),
    )
    report(
        "merge_splits bf16 S=5 D=128",
        lambda: compile_like_jit(
            pa._merge_splits_kernel,
            dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16"),
            dict(num_heads=32, head_dim=128, stride_ot=4096, stride_oh=128, stride_od=1),
            dict(NUM_SPLITS=5, BLOCK_S=8, BLOCK_D=128),
            num_warps=4,
        ),
    )
    sk_sampler = kernel_module("sampler")
    report(
        "sampler uniform_noise",
        lambda: compile_like_jit(
            sk_sampler._uniform_noise_kernel,
            dict(state_ptr="*i64", ids_ptr="*i64", out_ptr="*fp32"),
            dict(num_ids=7, stride_ids=0),
            dict(BLOCK=sk_sampler._BLOCK),
            num_warps=4,
        ),
    )
    report(
        "sampler race_draw",
        lambda: compile_like_jit(
            sk_sampler._race_draw_kernel,
            dict(logits_ptr="*fp32", temperature_ptr="*fp32", state_ptr="*i64", out_ptr="*i64"),
            dict(vocab_size=152064, stride_row=152064),
            dict(BLOCK=sk_sampler._BLOCK),
            num_warps=4,
        ),
    )
    kv_ints = dict(
        stride_kt=3072,
        stride_kh=128,
        stride_kd=1,
        stride_vt=3072,
        stride_vh=128,
        stride_vd=1,
        stride_kcb=16384,
        stride_kcs=1024,
        stride_kch=128,
        stride_kcd=1,
        stride_vcb=16384,
        stride_vcs=1024,
        stride_vch=128,
        stride_vcd=1,
        num_kv_heads=8,
        head_dim=128,
        stride_ksb=128,
        stride_kss=8,
        stride_ksh=1,
        stride_vsb=128,
        stride_vss=8,
        stride_vsh=1,
    )
    # cache element type, QUANT, QMAX: a float cache, and the quantizing stores
    for cache, quant, qmax in (("bf16", 0, 0.0), ("i8", 1, 127.0), ("fp8e4nv", 2, 448.0)):
        report(
            f"store_kv bf16 into {cache} Hkv=8 D=128",
            lambda c=cache, q=quant, m=qmax: compile_like_jit(
                sk._store_kv_kernel,
                dict(
                    k_ptr="*bf16",
                    v_ptr="*bf16",
                    k_cache_ptr="*" + c,
                    v_cache_ptr="*" + c,
                    slot_ptr="*i64",
                    k_scale_ptr="*fp32",
                    v_scale_ptr="*fp32",
                ),
                kv_ints,
                dict(BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128, QUANT=q, QMAX=m),
                num_warps=4,
            ),
        )
    report(
        "copy_blocks bf16 Hkv=8 D=128",
        lambda: compile_like_jit(
            cb._copy_blocks_kernel,
            dict(cache_ptr="*bf16", src_ptr="*i64", dst_ptr="*i64"),
            dict(
                stride_l=2 * 4096 * 16384,
                stride_kv=4096 * 16384,
                stride_b=16384,
                stride_s=1024,
                stride_h=128,
                stride_d=1,
                num_kv_heads=8,
                head_dim=128,
            ),
            dict(BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128),
            num_warps=4,
        ),
    )
    print("spills: " + ("SOME (see above)" if any_spills else "none"))
    print(f"compile failures: {failures}")
    return 1 if failures else 0


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def format_table(rows: list[Result]) -> str:
    header = (
        f"{'kernel':<18} {'case':<28} {'splits':>6} {'ms':>9} {'GB/s':>8} {'%copy':>6} "
        f"{'TFLOP/s':>8} {'ref ms':>9} {'speedup':>8} {'max err':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:

        def opt(value: float | None, fmt: str) -> str:
            return "-" if value is None else format(value, fmt)

        lines.append(
            f"{r.kernel:<18} {r.case:<28} {opt(r.num_splits, 'd'):>6} {r.time_ms:>9.4f} "
            f"{r.gb_per_s:>8.1f} {100 * r.frac_copy_bw:>5.1f}% {opt(r.tflops, '.1f'):>8} "
            f"{opt(r.ref_ms, '.3f'):>9} {opt(r.speedup, '.2f'):>8} {opt(r.max_abs_err, '.1e'):>8}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes; runs under the CPU interpreter"
    )
    parser.add_argument(
        "--compile-only", action="store_true", help="compile for sm_90 and report registers"
    )
    parser.add_argument(
        "--quick", action="store_true", help="GPU: a one-minute subset (scripts/gpu_check.sh)"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    args = parser.parse_args(argv)

    if args.compile_only:
        return compile_only()
    if not torch.cuda.is_available():
        if not args.smoke:
            parser.error("no GPU: use --smoke (interpreter) or --compile-only")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    kernels = kernel_module()
    reference = kernel_module("reference")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    torch.manual_seed(0)
    timer = make_timer(device)
    copy_bw = copy_bandwidth(device, timer, args.smoke)
    device_name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu"
    )
    print(f"device: {device_name}; copy bandwidth {copy_bw / 1e9:.1f} GB/s (read + write)")

    shape = dict(num_heads=4, num_kv_heads=2, head_dim=64, block_size=16) if args.smoke else {}
    rows: list[Result] = []
    start = time.perf_counter()
    cases = smoke_cases() if args.smoke else quick_cases() if args.quick else gpu_cases()
    for case in cases:
        rows.append(
            bench_attention(
                kernels, reference, timer, copy_bw, dtype=dtype, device=device, **{**shape, **case}
            )
        )
        print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    if args.smoke:
        rows.append(bench_store_kv(kernels, reference, timer, copy_bw, 8, dtype, device))
        rows.append(bench_copy_blocks(kernels, reference, timer, copy_bw, 2, 1, dtype, device))
    elif args.quick:
        rows.append(bench_store_kv(kernels, reference, timer, copy_bw, 16384, dtype, device))
        rows.append(bench_copy_blocks(kernels, reference, timer, copy_bw, 64, 32, dtype, device))
    else:
        for num_tokens in (64, 1024, 16384, 131072):
            rows.append(
                bench_store_kv(kernels, reference, timer, copy_bw, num_tokens, dtype, device)
            )
        for num_pairs in (1, 64):
            rows.append(
                bench_copy_blocks(kernels, reference, timer, copy_bw, num_pairs, 32, dtype, device)
            )
    print()
    print(format_table(rows))
    print(f"\n{len(rows)} cases in {time.perf_counter() - start:.1f}s")

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "device": device_name,
            "dtype": args.dtype,
            "copy_bandwidth_bytes_per_s": copy_bw,
            "attention_shape": {
                **dict(
                    num_heads=NUM_HEADS,
                    num_kv_heads=NUM_KV_HEADS,
                    head_dim=HEAD_DIM,
                    block_size=BLOCK_SIZE,
                ),
                **shape,
            },
            "results": [asdict(r) for r in rows],
            "python": sys.version.split()[0],
            "torch": torch.__version__,
        }
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
