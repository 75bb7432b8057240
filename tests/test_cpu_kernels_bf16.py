"""A bf16 model on the CPU runs the C kernels (layers and attention) and computes what the
pure-PyTorch bf16 path computes, up to bf16 rounding.

The kernels themselves are checked op by op in tests/test_cpu_kernels.py; here the wiring: the
layer classes chosen at load, the attention plans (every sequence and cascade prefix in a kernel),
and the teacher-forced logits of prefills, extends, decodes and cascades against ``native=False``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchgen.model.attention import TorchAttention
from batchgen.model.attention.torch_plan import TorchAttentionPlan
from batchgen.model.layers.activation import CpuSiluMul
from batchgen.model.layers.norm import CpuRMSNorm
from batchgen.model.layers.rotary import CpuRope
from batchgen.model.loader import load_model
from batchgen.tiny_model import make_tiny_model
from tests.optional import require
from tests.test_model import run_paged

CPU = torch.device("cpu")

# llama: head_dim 24 (the kernels' generic code); qwen2: 8:2 heads of 64 (the specialized code,
# AVX512-BF16 dot products where the CPU has them) with q/k/v biases; qwen3: q/k norms
MODELS = {
    "llama": dict(arch="llama", num_heads=4, num_kv_heads=2, head_dim=24),
    "qwen2": dict(arch="qwen2", num_heads=8, num_kv_heads=2, head_dim=64, hidden_size=128),
    "qwen3": dict(arch="qwen3", num_heads=8, num_kv_heads=2, head_dim=16),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: make_tiny_model(root / name, **kw) for name, kw in MODELS.items()}


class RecordingAttention(TorchAttention):
    """TorchAttention that keeps the plans it builds."""

    def __init__(self, native: bool) -> None:
        super().__init__(native)
        self.plans: list[TorchAttentionPlan] = []

    def prepare(self, meta, kv_cache, num_heads, dtype=None, window=None):  # type: ignore[no-untyped-def]
        plan = super().prepare(meta, kv_cache, num_heads, dtype, window)
        self.plans.append(plan)
        return plan


def workload(vocab: int) -> tuple[list[list[int]], list[list[int]], dict[int, tuple[int, int]]]:
    """Sequences (a shared 40-token prefix: 2 full blocks of 16), their chunk schedules (prefill,
    extends, decodes) and the shared blocks (cascades once the threshold is 0)."""
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (40,), generator=gen).tolist()
    tails = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (3, 9, 24)]
    seqs = [prefix + t for t in tails]
    schedules = [[40, 1, 1, 1], [0, 12, 1, 1, 1, 1, 1], [0, 8, 16, 1, 1, 1, 1, 1, 1, 1, 1]]
    return seqs, schedules, {1: (0, 2), 2: (0, 2)}


def logprob_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean |difference| of the log-softmax of two logits tensors ``[N, V]``."""
    return float((torch.log_softmax(a, -1) - torch.log_softmax(b, -1)).abs().mean())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bf16_model_runs_the_c_kernels_like_the_torch_path(
    name: str, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tiny random models amplify bf16 rounding (measured mean |logprob difference| to fp32:
    0.20 / 0.54 / 0.067 nats for llama / qwen2 / qwen3 on the PyTorch bf16 path), so the kernels'
    bf16 is held to that path's: much closer to it than it is to fp32 (measured 0.047 / 0.073 /
    0.042), and no further from fp32 than it is (1.01 / 1.02 / 0.99 times)."""
    from batchgen.model.attention import torch_plan

    require("cpu_kernels")
    monkeypatch.setattr(torch_plan, "_CASCADE_MIN_SAVED", 0)
    native_attn, torch_attn = RecordingAttention(True), RecordingAttention(False)
    native, info = load_model(model_dirs[name], CPU, torch.bfloat16, native_attn, native=True)
    plain, _ = load_model(model_dirs[name], CPU, torch.bfloat16, torch_attn, native=False)
    fp32, _ = load_model(model_dirs[name], CPU, torch.float32, TorchAttention(False), native=False)

    layer, attn = native.layers[0], native.layers[0].self_attn
    norms = [native.norm, layer.input_layernorm, layer.post_attention_layernorm]
    assert all(type(n) is CpuRMSNorm for n in norms)
    assert isinstance(attn.rope_, CpuRope) and isinstance(layer.mlp.silu_mul_, CpuSiluMul)

    seqs, schedules, shared = workload(info.vocab_size)
    logits = []
    for model in (native, plain, fp32):
        out = run_paged(model, seqs, schedules, 16, torch.Generator().manual_seed(1), shared)
        logits.append(torch.cat([o[~o.isnan().all(-1)] for o in out]))  # rows computed
    ours, ref, exact = logits

    # every step's attention ran in the kernels: per token, tiled and cascade prefixes
    assert native_attn.plans and all(
        p.kernels is not None and not p.groups for p in native_attn.plans
    )
    assert any(p.native_seqs is not None for p in native_attn.plans)
    assert any(p.tiled_seqs is not None for p in native_attn.plans)
    assert any(p.cascade_batch is not None for p in native_attn.plans)
    assert all(p.kernels is None for p in torch_attn.plans)

    assert ours.shape == ref.shape and torch.isfinite(ours).all()
    torch_error = logprob_distance(ref, exact)
    assert logprob_distance(ours, ref) <= 0.75 * torch_error
    assert logprob_distance(ours, exact) <= 1.15 * torch_error
    assert torch.nn.functional.cosine_similarity(ours, ref, dim=-1).min() > 0.998


def test_bf16_long_fresh_prefills_go_to_sdpa_beside_kernels_and_cascades(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a bf16 native plan with ``fresh_sdpa`` (what CPUs with AMX get) a fresh prefill of at
    least ``_FRESH_SDPA_MIN`` tokens runs in a PyTorch SDPA group (faster there than the tiled
    kernel), everything else in the kernels, in
    one step with a cascade (whose merge keeps the output fp32 until the end): the SDPA rows are
    bit for bit the PyTorch path's, the rest within bf16 rounding of it."""
    from batchgen.model.attention import AttentionMetadata, torch_plan

    require("cpu_kernels")
    monkeypatch.setattr(torch_plan, "_CASCADE_MIN_SAVED", 0)
    hq, hkv, d, bs = 8, 2, 64, 16
    fresh = torch_plan._FRESH_SDPA_MIN
    short = 40  # a fresh prefill below the threshold: the tiled kernel
    nf, ns = -(-fresh // bs), -(-short // bs)
    # sequences: long fresh, short fresh, two cascade members (2 shared blocks + 3 new of 35
    # keys), a decode (20 keys)
    tables = [
        list(range(1, 1 + nf)),
        list(range(1 + nf, 1 + nf + ns)),
        [40 + nf, 41 + nf, 42 + nf],
        [40 + nf, 41 + nf, 43 + nf],
        [44 + nf, 45 + nf],
    ]
    k_lens, q_lens = [fresh, short, 35, 35, 20], [fresh, short, 3, 3, 1]
    num_blocks = 46 + nf
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(2, num_blocks, bs, hkv, d, generator=gen).bfloat16()
    bt = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int32)
    slots = []
    for b, table in enumerate(tables):
        bt[b, : len(table)] = torch.tensor(table)
        slots += [table[p // bs] * bs + p % bs for p in range(k_lens[b] - q_lens[b], k_lens[b])]
    slot_mapping = torch.tensor(slots)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=bt,
        cu_seqlens_q=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(k_lens, dtype=torch.int32),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(k_lens),
    )
    q = torch.randn(sum(q_lens), hq, d, generator=gen).bfloat16()
    kv = cache.view(2, -1, hkv, d)[:, slot_mapping]  # the new tokens' K/V, stored again
    outs, plans = [], []
    for native in (True, False):
        attn = TorchAttention(native, fresh_sdpa=True)
        plan = attn.prepare(meta, cache[None], hq)
        plans.append(plan)
        outs.append(attn.forward(q, kv[0], kv[1], cache[0], cache[1], plan, 0.125))
    plan = plans[0]
    assert plan.kernels is not None and plan.cascade_batch is not None
    assert [(g.kind, g.n) for g in plan.groups] == [(torch_plan.FRESH, 1)]
    assert plan.tiled_seqs is not None and 1 in plan.tiled_seqs.tolist()
    ours, ref = outs
    assert ours.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(ours[:fresh], ref[:fresh])
    torch.testing.assert_close(ours.float(), ref.float(), atol=2e-2, rtol=2e-2)
    # without AMX (fresh_sdpa False) the long fresh prefill goes to the tiled kernel too
    attn = TorchAttention(True, fresh_sdpa=False)
    plan = attn.prepare(meta, cache[None], hq)
    assert not plan.groups and plan.tiled_seqs is not None and 0 in plan.tiled_seqs.tolist()
    out = attn.forward(q, kv[0], kv[1], cache[0], cache[1], plan, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
