"""The sampler's randomness: stream keys and counter-based noise, the same on every device.

A sample's random stream is named by a 63-bit key (:func:`rng_key`: seed, row id and sample
index). The noise for the token at ``position`` is a counter-based hash (splitmix64) of (key,
position, vocab id): it does not depend on what else is in the batch, on the order of rows, or on
how many steps ran before, so a sample resumed after an interruption draws the same tokens.
:class:`SamplerKernels` lets a caller pass native versions of the hot loops (bit-identical noise).
"""

from __future__ import annotations

import hashlib
import json
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

# ---------------------------------------------------------------------------------------------
# Stream keys
# ---------------------------------------------------------------------------------------------

_KEY_DOMAIN = "batchgen.rng.v1"  # bump only on purpose: it changes every seeded output
_MASK63 = (1 << 63) - 1


def rng_key(seed: int, row_id: int | str, sample_index: int) -> int:
    """The 63-bit key of the random stream of sample ``sample_index`` of input row ``row_id``.

    A BLAKE2b digest of a canonical JSON encoding, so it is the same in every process and on every
    machine (Python's ``hash()`` is salted per process and is not used). The integer id ``7`` and
    the string id ``"7"`` get different keys. The result fits a non-negative int64.
    """
    seed = operator.index(seed)
    sample_index = operator.index(sample_index)
    if isinstance(row_id, str):
        rid: int | str = row_id
    else:
        try:
            rid = operator.index(row_id)  # accepts numpy / arrow integer scalars
        except TypeError:
            raise TypeError(
                f"row id must be an int or a str, got {type(row_id).__name__}"
            ) from None
    payload = json.dumps([_KEY_DOMAIN, seed, rid, sample_index], separators=(",", ":"))
    digest = hashlib.blake2b(payload.encode("ascii"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK63


# ---------------------------------------------------------------------------------------------
# Native kernels
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplerKernels:
    """Native versions of the sampler's hot loops, passed in by the caller (the engine picks the
    C kernels on CPU, the Triton kernels on CUDA); a None field keeps the PyTorch formula. All
    are called on tensors of ``device_type`` only and must match the formula: the noise bit for
    bit, the kept set and the draw up to float rounding in near-ties.

    - ``uniform_noise(state, ids, k)``: row states ``[S]`` int64 (``row_state``), vocab ids
      ``[S, k]`` or ``[1, k]`` int64 with contiguous rows -> ``[S, k]`` float32, ``uniform_at``;
    - ``race_draw(logits, temperature, state)``: ``[S, V]`` float32 logits with contiguous rows,
      ``[S]`` float32 temperatures, ``[S]`` int64 row states -> ``[S]`` int64, ``_draw_plain``;
    - ``filtered_draw(logits, temperature, top_k, top_p, min_p, state)``: ``[S, V]`` float32
      logits, ``[S]`` float32 temperatures, ``[S]`` int64 top_k (0 = off), ``[S]`` float32 top_p
      and min_p, ``[S]`` int64 row states -> ``[S]`` int64, ``_draw_filtered`` (the rows that
      filter; the top-k / top-p / min-p rules of ``batchgen.engine.sampler``).
    """

    uniform_noise: Callable[[Tensor, Tensor, int], Tensor] | None = None
    race_draw: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None
    filtered_draw: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], Tensor] | None = None
    device_type: str = "cpu"  # the tensors' device type the kernels run on


TORCH_FORMULA = SamplerKernels()  # no native kernels: the PyTorch formula everywhere

# ---------------------------------------------------------------------------------------------
# Counter-based noise (splitmix64 on int64 tensors)
# ---------------------------------------------------------------------------------------------


def _signed64(x: int) -> int:
    """Reinterpret the low 64 bits of ``x`` as a two's-complement int64 (torch has no uint64 maths)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= (1 << 63) else x


_GAMMA = _signed64(0x9E3779B97F4A7C15)  # splitmix64 increment (odd: a full-period counter step)
_MUL1 = _signed64(0xBF58476D1CE4E5B9)
_MUL2 = _signed64(0x94D049BB133111EB)
_MIX_STEPS = ((30, _MUL1), (27, _MUL2), (31, None))
_LOW24 = (1 << 24) - 1


def _low_mask(bits: int) -> int:
    """``bits`` ones in the low bits: after an arithmetic ``>> (64 - bits)`` it clears the sign fill."""
    return (1 << bits) - 1


def _mix64_(z: Tensor, tmp: Tensor) -> Tensor:
    """splitmix64's output function, in place on int64 ``z`` (any shape); ``tmp`` is scratch.

    Multiplication wraps modulo 2**64 on int64 tensors, which is exactly the unsigned arithmetic
    of the reference; a logical right shift is an arithmetic one with the sign fill masked off.
    """
    for shift, mult in _MIX_STEPS:
        torch.bitwise_right_shift(z, shift, out=tmp)
        tmp.bitwise_and_(_low_mask(64 - shift))
        z.bitwise_xor_(tmp)
        if mult is not None:
            z.mul_(mult)
    return z


def _mix64(x: Tensor) -> Tensor:
    """Out-of-place ``_mix64_`` (for small [S] tensors)."""
    z = x.clone()
    return _mix64_(z, torch.empty_like(z))


def row_state(rng_key: Tensor, position: Tensor) -> Tensor:
    """Per-(key, position) 64-bit state, [S] int64: the ``position``-th splitmix64 output of the
    stream seeded by the mixed key. Distinct positions give distinct states for a key."""
    return _mix64(_mix64(rng_key) + position * _GAMMA)


def uniform_at(
    rng_key: Tensor, position: Tensor, ids: Tensor, kernels: SamplerKernels = TORCH_FORMULA
) -> Tensor:
    """Uniform noise for the given vocab ids: [S, K] float32 in (0, 1).

    rng_key, position: [S] int64. ids: [S, K] or [1, K] int64 vocab ids. The value at (r, j)
    depends only on (rng_key[r], position[r], ids[r, j]); so noise gathered at a permutation of the
    vocabulary equals the same permutation of the noise over the whole vocabulary.
    """
    state = row_state(rng_key, position)  # [S]
    if state.device.type == kernels.device_type and kernels.uniform_noise is not None:
        # the same bits from a native kernel, in one pass instead of about twenty
        return kernels.uniform_noise(state, ids.contiguous(), ids.shape[1])
    z = (ids + 1) * _GAMMA + state[:, None]  # [S, K] int64, a splitmix64 counter per vocab id
    tmp = torch.empty_like(z)
    _mix64_(z, tmp)
    # 48 random bits as hi * 2**-24 + lo * 2**-48. Each half is a 24-bit integer (exact in
    # float32) and the scalings are powers of two, so the only rounding is one IEEE add: the result
    # is bit-identical on every device and code path, and small values keep full relative
    # precision (they decide the rare low-probability tokens in the race).
    # (int64 -> int32 -> float32 is exact here and much faster on CPU than int64 -> float32.)
    torch.bitwise_right_shift(z, 40, out=tmp)
    u = tmp.bitwise_and_(_LOW24).to(torch.int32).to(torch.float32).mul_(2.0**-24)  # [S, K]
    torch.bitwise_right_shift(z, 16, out=tmp)
    u.add_(tmp.bitwise_and_(_LOW24).to(torch.int32).to(torch.float32), alpha=2.0**-48)
    # Keep strictly inside (0, 1): 0 has probability 2**-48; the sum can round up to 1.0.
    return u.clamp_(2.0**-49, 1.0 - 2.0**-24)


def uniform_noise(
    rng_key: Tensor, position: Tensor, vocab_size: int, kernels: SamplerKernels = TORCH_FORMULA
) -> Tensor:
    """Uniform noise over the whole vocabulary: [S, V] float32, values strictly in (0, 1).

    rng_key, position: [S] int64. Row r depends only on (rng_key[r], position[r]) and the vocab
    index, never on the other rows: batch-invariant and reproducible across processes.
    """
    ids = torch.arange(vocab_size, dtype=torch.int64, device=rng_key.device)[None, :]  # [1, V]
    return uniform_at(rng_key, position, ids, kernels)


def exponential_at(
    rng_key: Tensor, position: Tensor, ids: Tensor, kernels: SamplerKernels
) -> Tensor:
    """Exp(1) variates for the given vocab ids, [S, K] float32 (positive, finite).

    ``E = -log(1 - u)``: the same law as ``-log(u)``, but small ``E`` (the winners of the race)
    come from small ``u``, where float32 has the most precision.
    """
    return uniform_at(rng_key, position, ids, kernels).neg_().log1p_().neg_()
