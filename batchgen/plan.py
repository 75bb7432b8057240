"""The job plan: where and how a job's engine runs, decided once for ``validate`` and ``run``.

- :class:`Placement`: device, dtype and attention backend, with ``auto`` resolved.
- The KV plan: how many blocks the pool gets (:func:`plan_num_blocks`) and the longest sequence
  that fits (:func:`max_model_len`). The block count depends on free memory, so an engine plans it
  again right after loading its model; numbers derived at run time are returned, never written
  back into the job.
- The mapping from the job's sections to the engine's frozen configs.
- :func:`describe`: the plan as ``validate`` prints it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from batchgen.engine.backends import Backends, Switches, choose_backends
from batchgen.engine.engine import EngineSettings
from batchgen.engine.request import SamplingParams
from batchgen.errors import JobError
from batchgen.fingerprint import numerics
from batchgen.job import Job
from batchgen.model.config import ModelInfo
from batchgen.model.cpu_features import bf16_support
from batchgen.results import read_manifest

CPU_KV_CACHE_CAP = 1 << 30  # bytes: "auto" never takes more than this on a CPU
CPU_KV_CACHE_SHARE = 0.25  # of available memory, for "auto" on a CPU
GPU_KV_CACHE_SHARE = 0.85  # of free device memory after the model is loaded
GPU_RESERVE_SHARE = 0.04  # of total device memory kept free (allocator fragmentation, CUDA ctx)
DEFAULT_CPU_MEMORY = 8 << 30  # assumed available where /proc/meminfo cannot be read


# engine.kv_cache_dtype values (but auto) -> the cache tensor's dtype
KV_CACHE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
}
QUANTIZED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype
    backend: str  # "torch" | "triton"
    dtype_reason: str = "set in the job"  # why this dtype, as validate and the report say it
    kv_dtype: torch.dtype | None = None  # the KV cache's dtype; None: dtype

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The KV cache tensor's dtype (int8 / float8_e4m3fn: quantized, with scales)."""
        return self.kv_dtype or self.dtype

    @property
    def kv_dtype_name(self) -> str:
        """As ``engine.kv_cache_dtype`` spells it (``fp8_e4m3``, ``int8``, ``float32``, ...)."""
        return kv_dtype_name(self.kv_cache_dtype)


def kv_dtype_name(dtype: torch.dtype) -> str:
    """``engine.kv_cache_dtype``'s name of a cache dtype."""
    return next(name for name, d in KV_CACHE_DTYPES.items() if d == dtype)


def resolve_kv_cache_dtype(name: str, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """``engine.kv_cache_dtype`` on ``device`` with compute ``dtype``: auto is dtype; JobError
    for a combination no attention path runs: fp8_e4m3 on a CPU or on a GPU without fp8
    (compute capability < 8.9), and a float cache of another dtype than the compute dtype."""
    if name == "auto":
        return dtype
    kv = KV_CACHE_DTYPES[name]
    if kv == torch.float8_e4m3fn:
        if device.type != "cuda":
            raise JobError(
                "engine.kv_cache_dtype fp8_e4m3 needs a CUDA GPU with fp8 (compute capability "
                "8.9+); on a CPU use int8"
            )
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise JobError(
                f"engine.kv_cache_dtype fp8_e4m3 needs a GPU with fp8 (compute capability 8.9+); "
                f"{device} is {major}.{minor}: use int8"
            )
    elif kv not in QUANTIZED_KV_DTYPES and kv != dtype:
        compute = str(dtype).removeprefix("torch.")
        raise JobError(
            f"engine.kv_cache_dtype {name} differs from the compute dtype {compute}: a float KV "
            f"cache is kept in the compute dtype (set auto or {compute}, or int8 to quantize)"
        )
    return kv


def resolve_placement(job: Job) -> Placement:
    """The job's engine settings with ``auto`` resolved; JobError for impossible ones."""
    eng = job.engine
    if eng.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(eng.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise JobError(f"engine.device is {eng.device!r} but no CUDA device is available")
    if eng.dtype == "auto":
        dtype, reason = auto_dtype(device)
    else:
        dtype, reason = getattr(torch, eng.dtype), "set in the job"
    if eng.attention_backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    else:
        backend = eng.attention_backend
    _check_cuda_graphs(eng.cuda_graphs, device, backend)
    interpreted = Switches.from_environment().triton_interpret
    if backend == "triton" and device.type == "cpu" and not interpreted:
        raise JobError(
            "engine.attention_backend is 'triton' on a CPU: set TRITON_INTERPRET=1 "
            "(slow, for testing) or use 'torch'"
        )
    kv_dtype = resolve_kv_cache_dtype(eng.kv_cache_dtype, device, dtype)
    return Placement(device, dtype, backend, reason, kv_dtype)


def plan_backends(place: Placement) -> Backends:
    """The kernels of an engine of this placement, chosen once (the model is built with them and
    the engine runs them): :func:`batchgen.engine.backends.choose_backends`."""
    return choose_backends(place.device, place.dtype, place.backend)


def _check_cuda_graphs(setting: str, device: torch.device, backend: str) -> None:
    """``engine.cuda_graphs``: ``off`` and ``auto`` run without graphs (``auto`` stays off until
    graph-captured decode steps are verified on a GPU); ``on`` needs CUDA and triton."""
    if setting != "on":
        return
    if device.type != "cuda":
        raise JobError(
            f"engine.cuda_graphs is 'on' but the engine runs on {device}: CUDA graphs need a "
            "CUDA device (use 'auto' or 'off')"
        )
    if backend != "triton":
        raise JobError("engine.cuda_graphs is 'on': it needs engine.attention_backend triton")


def auto_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """What ``engine.dtype: auto`` resolves to on ``device``, and why: bf16 on GPUs and on CPUs
    with bf16 matrix instructions (AMX, AVX512-BF16), float32 on other CPUs (which emulate bf16,
    far slower than fp32)."""
    if device.type == "cuda":
        return torch.bfloat16, "auto: bfloat16 on GPUs"
    support = bf16_support()
    if support.native:
        return torch.bfloat16, f"auto: this CPU multiplies bf16 natively ({support.describe()})"
    return torch.float32, f"auto: this CPU has {support.describe()}, so bf16 would be slow"


# What ``auto`` gave before the CPU choice depended on the CPU's bf16 instructions: the numerics
# of every folder written before numerics were fingerprinted.
_LEGACY_AUTO = {"cuda": torch.bfloat16, "cpu": torch.float32}


def job_numerics(job: Job, folder: Path) -> tuple[str, tuple[str, ...]]:
    """The numerics for the job's fingerprint (:func:`~batchgen.fingerprint.numerics`), and the
    fingerprint keys an output folder may lack (``adopt`` of :meth:`OutputFolder.open`).

    Resolved as :func:`resolve_placement` does. Ray workers resolve their own placement: with an
    explicit ``engine.dtype`` theirs is the same; with ``auto`` it is known once they report it,
    so the folder's recorded numerics are taken as they are, and the job loop checks the
    executor's against them. A folder written before numerics were fingerprinted resumes when
    the job runs in what ``auto`` gave then (float32 on CPUs, bfloat16 on GPUs); its numerics
    are recorded from then on.
    """
    eng = job.engine
    if eng.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(eng.device)
    dtype = auto_dtype(device)[0] if eng.dtype == "auto" else getattr(torch, eng.dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    kv_name = dtype_name if eng.kv_cache_dtype == "auto" else eng.kv_cache_dtype
    text = numerics(dtype_name, kv_name)
    if job.executor.kind == "ray" and eng.dtype == "auto":
        with contextlib.suppress(JobError):
            recorded = ((read_manifest(folder) or {}).get("fingerprint") or {}).get("numerics")
            if isinstance(recorded, str):
                text = recorded
    legacy = _LEGACY_AUTO.get(device.type, torch.float32)
    return text, (("numerics",) if dtype == legacy else ())


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return DEFAULT_CPU_MEMORY


def cuda_kv_budget(free: int, total: int, activation_peak: int) -> int:
    """Bytes ``kv_cache_memory: auto`` gives the KV cache on a CUDA device.

    ``free``: ``torch.cuda.mem_get_info`` after the model is loaded and the allocator's cache was
    emptied (so the weights, and whatever other processes hold, are already taken out);
    ``activation_peak``: what the worst step allocates on top (:func:`measure_activation_peak`);
    a reserve of ``GPU_RESERVE_SHARE`` of the device stays free. Never negative.
    """
    return max(0, free - activation_peak - int(total * GPU_RESERVE_SHARE))


def _cuda_free_after_empty_cache(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of ``device`` once the caching allocator has returned what it holds
    unused (the weights' loading leaves freed halves of fused projections cached)."""
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)


def plan_num_blocks(
    job: Job, info: ModelInfo, place: Placement, model: torch.nn.Module | None = None
) -> int:
    """KV blocks for the pool: kv_cache_blocks, else kv_cache_memory, else a share of free memory.

    On CUDA with ``kv_cache_memory: auto``, ``model`` (the loaded model) lets the step's
    activation peak be measured first; without it (``validate``) a share of free memory is
    planned instead.
    """
    eng = job.engine
    block_bytes = info.kv_bytes_per_token(place.kv_cache_dtype) * eng.block_size
    if eng.kv_cache_blocks is not None:
        return eng.kv_cache_blocks
    if eng.kv_cache_memory != "auto":
        blocks = int(eng.kv_cache_memory) // block_bytes
    elif place.device.type == "cuda" and model is not None:
        blocks = _cuda_auto_blocks(job, info, place, model) // block_bytes
    elif place.device.type == "cuda":
        blocks = int(_available_memory(place.device) * GPU_KV_CACHE_SHARE) // block_bytes
    else:
        budget = min(int(_available_memory(place.device) * CPU_KV_CACHE_SHARE), CPU_KV_CACHE_CAP)
        blocks = budget // block_bytes
    if blocks < 1:
        raise JobError(
            f"engine.kv_cache_memory leaves no room for one KV block ({block_bytes} bytes)"
        )
    return blocks


def _cuda_auto_blocks(job: Job, info: ModelInfo, place: Placement, model: torch.nn.Module) -> int:
    """``cuda_kv_budget`` with the activation peak measured on the loaded model."""
    from batchgen.engine.memory import measure_activation_peak

    eng = job.engine
    peak = measure_activation_peak(
        model,
        info,
        max_num_batched_tokens=eng.max_num_batched_tokens,
        max_num_seqs=eng.max_num_seqs,
        block_size=eng.block_size,
        device=place.device,
        dtype=place.dtype,
    )
    free, total = _cuda_free_after_empty_cache(place.device)
    return cuda_kv_budget(free, total, peak)


def max_model_len(job: Job, info: ModelInfo, num_blocks: int) -> int:
    """The longest sequence (prompt + output) the engine runs."""
    limit = info.max_model_len
    if job.engine.max_model_len is not None:
        limit = min(limit, job.engine.max_model_len)
    # One sequence must fit in the pool, or it could never be scheduled.
    return min(limit, num_blocks * job.engine.block_size)


def engine_settings(job: Job, place: Placement, num_blocks: int, length: int) -> EngineSettings:
    eng = job.engine
    return EngineSettings(
        block_size=eng.block_size,
        num_blocks=num_blocks,
        max_num_seqs=eng.max_num_seqs,
        max_num_batched_tokens=eng.max_num_batched_tokens,
        max_model_len=length,
        prefix_caching=eng.prefix_caching,
        attention_backend=place.backend,
        cuda_graphs=eng.cuda_graphs == "on",  # auto: off until verified on a GPU
        overlap=resolve_overlap(eng.overlap, place.device),
    )


def resolve_overlap(setting: str, device: torch.device) -> bool:
    """``engine.overlap``: ``auto`` overlaps the host's work with the device's on CUDA only (a
    CPU engine computes on the host: nothing to overlap); ``on`` works on any device (tests)."""
    if setting == "auto":
        return device.type == "cuda"
    return setting == "on"


def sampling_params(job: Job) -> SamplingParams:
    """The engine's sampling parameters: every field of :class:`SamplingParams` taken from the
    job's ``sampling:`` section of the same name (``structured`` is compiled apart)."""
    return SamplingParams(**{f.name: getattr(job.sampling, f.name) for f in fields(SamplingParams)})


def describe_engine(job: Job, info: ModelInfo, place: Placement) -> list[str]:
    """The ``device``, ``KV cache`` and ``max_model_len`` lines of ``validate``'s plan."""
    num_blocks = plan_num_blocks(job, info, place)
    per_token = info.kv_bytes_per_token(place.kv_cache_dtype)
    bs = job.engine.block_size
    length: int | str = max_model_len(job, info, num_blocks)
    if length < min(info.max_model_len, job.engine.max_model_len or info.max_model_len):
        length = f"{length} (all the KV cache holds: longer prompts will be error rows)"
    scales = (
        " with a fp32 scale per token and KV head"
        if place.kv_dtype_name in ("int8", "fp8_e4m3")
        else ""
    )
    return [
        f"device:   {place.device} {place.dtype_name} ({place.dtype_reason}), "
        f"attention {place.backend}, overlap "
        f"{'on' if resolve_overlap(job.engine.overlap, place.device) else 'off'}",
        f"KV cache: {place.kv_dtype_name}{scales}, {per_token} bytes/token; holds "
        f"{num_blocks * bs} tokens ({num_blocks} blocks x {bs}, "
        f"{num_blocks * bs * per_token / 2**20:.1f} MiB)",
        f"max_model_len: {length}",
    ]


def describe_executor(job: Job) -> str:
    """The ``executor:`` line of ``validate``'s plan."""
    ex = job.executor
    if ex.kind == "local":
        return "executor: local (one engine in this process)"
    where = "a local Ray cluster started for the job" if ex.address is None else ex.address
    if ex.num_workers is not None:
        workers = f"{ex.num_workers} workers"
    elif ex.num_gpus is None:
        workers = (
            "one worker per GPU of the cluster "
            f"(per {ex.num_cpus:g} CPUs on a cluster without GPUs)"
        )
    elif ex.num_gpus > 0:
        workers = f"one worker per {ex.num_gpus:g} GPUs of the cluster"
    else:
        workers = f"one worker per {ex.num_cpus:g} CPUs of the cluster"
    gpus = "1 if the cluster has GPUs, else 0" if ex.num_gpus is None else f"{ex.num_gpus:g}"
    return (
        f"executor: ray on {where}: {workers}, each num_cpus={ex.num_cpus:g}, "
        f"num_gpus={gpus}, max_restarts={ex.max_restarts}"
    )
