"""The kernels one engine runs, chosen in one place.

:func:`choose_backends` makes every choice of implementation for an engine on a device and dtype,
once: the model's attention backend, its layers' implementations (C kernels, packed GEMMs or
PyTorch ops), the block copy of copy-on-write and the sampler's kernels. The job's plan calls it
(:mod:`batchgen.executors.local` builds the model and the engine from the one
:class:`Backends` it returns); an :class:`~batchgen.engine.engine.Engine` built without one (tests,
scripts) gets the same choice. The environment switches that change the choice are read here and
nowhere else (:class:`Switches`; docs/development.md lists them).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from batchgen.engine.noise import TORCH_FORMULA, SamplerKernels
from batchgen.model import cpu_kernels
from batchgen.model.attention import AttentionBackend, make_attention_backend
from batchgen.model.attention.torch_backend import TorchAttention
from batchgen.model.layers.backend import LayerBackend

__all__ = ["Backends", "CopyBlocks", "Switches", "choose_backends"]

# copy_blocks(cache, src, dst): copy block src[i] to dst[i] in every layer, for K and V
CopyBlocks = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class Switches:
    """The environment switches of the kernel choice (all on by default).

    ``cpu_kernels``: ``BATCHGEN_CPU_KERNEL=0`` runs everything in PyTorch on a CPU;
    ``cpu_avx512bf16``: ``BATCHGEN_CPU_KERNEL_AVX512BF16=0`` builds the C kernels' portable
    variant; ``pack_weights``: ``BATCHGEN_PACK_WEIGHTS=0`` keeps ``F.linear`` (no MKL, oneDNN
    or AVX512-BF16 packing); ``triton_interpret``: ``TRITON_INTERPRET=1`` lets the Triton
    backend run on a CPU.
    One more changes no kernel but is read here with them: ``profile``, ``BATCHGEN_PROFILE=1``
    (off by default), times each engine step's phases (:mod:`batchgen.engine.profile`) into the
    report.
    """

    cpu_kernels: bool = True
    cpu_avx512bf16: bool = True
    pack_weights: bool = True
    triton_interpret: bool = False
    profile: bool = False

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> Switches:
        env = os.environ if env is None else env
        return cls(
            cpu_kernels=env.get("BATCHGEN_CPU_KERNEL", "1") != "0",
            cpu_avx512bf16=env.get("BATCHGEN_CPU_KERNEL_AVX512BF16", "1") != "0",
            pack_weights=env.get("BATCHGEN_PACK_WEIGHTS", "1") != "0",
            triton_interpret=env.get("TRITON_INTERPRET") == "1",
            profile=env.get("BATCHGEN_PROFILE") == "1",
        )


@dataclass(frozen=True)
class Backends:
    """Every kernel choice of one engine: the model is built with ``attention`` and ``layers``,
    the engine copies blocks with ``copy_blocks`` and samples with ``sampler``."""

    attention: AttentionBackend[Any]  # TorchAttention (CPU, PyTorch and C) or TritonAttention
    layers: LayerBackend  # C kernels, packed GEMM or PyTorch ops for norms, RoPE, MLP, linears
    copy_blocks: CopyBlocks  # the Triton kernel, or torch indexing (imports no Triton)
    sampler: SamplerKernels  # Triton on CUDA, the C kernels' noise and draw on a CPU, or torch


def choose_backends(
    device: torch.device,
    dtype: torch.dtype,
    attention_backend: str,
    switches: Switches | None = None,
) -> Backends:
    """The implementations for an engine on ``device`` computing in ``dtype`` with the resolved
    ``engine.attention_backend`` (``"torch"`` or ``"triton"``); ``switches``: from the
    environment unless given."""
    sw = Switches.from_environment() if switches is None else switches
    if attention_backend == "torch":
        attention: AttentionBackend[Any] = TorchAttention(sw.cpu_kernels, sw.cpu_avx512bf16)
    else:
        attention = make_attention_backend(attention_backend)
    layers = LayerBackend.select(
        device, dtype, sw.cpu_kernels, pack=sw.pack_weights, avx512bf16=sw.cpu_avx512bf16
    )
    return Backends(
        attention=attention,
        layers=layers,
        copy_blocks=_copy_blocks(attention_backend),
        sampler=_sampler_kernels(device, sw),
    )


def _sampler_kernels(device: torch.device, sw: Switches) -> SamplerKernels:
    """The Triton kernels' noise, plain draw and filtered draw on CUDA; the C kernels' noise and
    plain draw on a CPU when they can be built (filtered rows rank in PyTorch there)."""
    if device.type == "cuda":
        from batchgen.kernels.sampler import filtered_draw, race_draw, uniform_noise

        return SamplerKernels(
            uniform_noise=uniform_noise,
            race_draw=race_draw,
            filtered_draw=filtered_draw,
            device_type="cuda",
        )
    native = None
    if device.type == "cpu" and sw.cpu_kernels:
        native = cpu_kernels.load(sw.cpu_avx512bf16)
    if native is None:
        return TORCH_FORMULA
    return SamplerKernels(uniform_noise=native.uniform_noise, race_draw=native.race_draw)


def _copy_blocks(attention_backend: str) -> CopyBlocks:
    if attention_backend == "triton":
        from batchgen.kernels import copy_blocks

        return copy_blocks
    from batchgen.model.block_copy import copy_blocks  # the torch path imports no Triton

    return copy_blocks
