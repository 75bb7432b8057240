"""Count the variants the Triton JIT would compile for the launches a test makes, under the
interpreter (no GPU).

A compiled ``JITFunction`` keeps one binary per key of its cache (``device_caches[device][0]``):
the key is the launch's *specialization* (argument dtypes, integers equal to 1 or divisible by
16, pointers aligned to 16 bytes, every constexpr) plus the compile options (``num_warps``, ...).
The interpreter compiles nothing, so :class:`VariantCounter` records each launch of an
interpreted kernel (a pre-run hook), rebuilds the ``JITFunction`` of the same source with the
same ``do_not_specialize`` lists, and computes its cache key with Triton's own binder for an
sm_90 target. Distinct keys = the binaries a GPU run would have compiled.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature


class VariantCounter:
    """``with VariantCounter(kernel_a, kernel_b) as c: ...; c.count(kernel_a)``."""

    def __init__(self, *kernels: Any) -> None:
        self.kernels = kernels
        self.keys: dict[str, set[str]] = defaultdict(set)
        backend = make_backend(GPUTarget("cuda", 90, 32))
        self._binders = {}
        for kernel in kernels:
            jit = JITFunction(kernel.fn, **_specialize_options(kernel))
            self._binders[_name(kernel)] = create_function_from_signature(
                jit.signature, jit.params, backend
            )
        self._hooks: list[tuple[Any, Any]] = []

    def __enter__(self) -> VariantCounter:
        for kernel in self.kernels:
            name = _name(kernel)

            def hook(*args: Any, _name: str = name, **kwargs: Any) -> None:
                self._record(_name, args, kwargs)

            kernel.add_pre_run_hook(hook)
            self._hooks.append((kernel, hook))
        return self

    def __exit__(self, *exc: object) -> None:
        for kernel, hook in self._hooks:
            kernel.pre_run_hooks.remove(hook)

    def _record(self, name: str, args: tuple, kwargs: dict) -> None:
        kwargs = {k: v for k, v in kwargs.items() if k != "grid"}
        _, specialization, options = self._binders[name](*args, **kwargs)
        self.keys[name].add(compute_cache_key({}, specialization, options))

    def count(self, kernel: Any) -> int:
        """Distinct compiled variants of ``kernel`` launched inside the block."""
        return len(self.keys[_name(kernel)])


def _name(kernel: Any) -> str:
    return f"{kernel.fn.__module__}.{kernel.fn.__qualname__}"


def _specialize_options(kernel: Any) -> dict:
    """The decorator's specialisation lists, as the interpreted function kept them."""
    kw = getattr(kernel, "kwargs", {})
    return {k: kw[k] for k in ("do_not_specialize", "do_not_specialize_on_alignment") if k in kw}
