"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral) against transformers, and the expert
compute against its definition.

- routing: top-k with ties to the lowest expert id, renormalization, HF's formula elsewhere;
- the fused experts (sorted by expert, one GEMM pair per expert with tokens) against the
  token-by-token definition: experts with no token, tokens with identical expert sets, one token,
  MKL-packed (fp32) and PyTorch (fp32, bf16) weights;
- teacher-forced logits of tiny random models of the three architectures through the paged cache
  (chunked prefill, decode, several sequences per step) against transformers, in both checkpoint
  layouts (per expert, as ``save_pretrained`` writes; transformers' fused tensors);
- whole jobs through the CLI: greedy output equals transformers' ``generate``, seeded samples are
  the same with every batch limit, with and without the prefix cache, and forks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from batchgen.errors import ModelError
from batchgen.model import packed_linear
from batchgen.model.attention import TorchAttention
from batchgen.model.layers.backend import LayerBackend
from batchgen.model.layers.moe import FusedExperts, experts_reference, route
from batchgen.model.loader import load_model
from batchgen.model.packed_linear import Mkl
from batchgen.model.registry import SUPPORTED_ARCHITECTURES, read_model_config
from batchgen.tiny_model import make_prompts
from tests.hf_reference import MOE_ARCHS, hf_greedy, hf_logits
from tests.jobkit import run_job, samples_with_and_without_prefix_cache, write_job
from tests.optional import require
from tests.test_model import assert_close_logits, run_paged, schedules_for
from tests.ties import compare_samples

CPU = torch.device("cpu")


# --------------------------------------------------------------------------------------------
# routing and the fused experts
# --------------------------------------------------------------------------------------------


def test_route_breaks_ties_to_the_lowest_expert_id() -> None:
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 0.0, 3.0],  # three-way tie for first: experts 1 and 2
            [2.0, 2.0, 2.0, 2.0, 2.0],  # all tied: experts 0 and 1
            [0.0, 1.0, 5.0, 1.0, -1.0],  # a tie for second: expert 1 before 3
        ]
    )
    weights, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [0, 1], [2, 1]]
    probs = torch.softmax(logits, dim=-1)
    assert torch.equal(weights, probs.gather(1, ids))
    weights, ids = route(logits, 2, renormalize=True)
    assert torch.allclose(weights.sum(-1), torch.ones(3))
    assert torch.equal(weights[1], torch.tensor([0.5, 0.5]))
    # bf16 logits (a bf16 model's router): the same rule, weights in fp32
    weights, ids = route(logits.bfloat16(), 2, renormalize=True)
    assert ids.tolist() == [[1, 2], [0, 1], [2, 1]] and weights.dtype == torch.float32


def test_route_is_transformers_router_without_ties() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 16, generator=gen)
    for renormalize in (False, True):
        weights, ids = route(logits, 4, renormalize)
        probs = torch.softmax(logits, dim=-1)
        top, top_ids = torch.topk(probs, 4, dim=-1)  # HF's routers (no ties in random logits)
        if renormalize:
            top = top / top.sum(-1, keepdim=True)
        assert torch.equal(ids, top_ids) and torch.allclose(weights, top)


def experts_for(
    e: int, h: int, inter: int, dtype: torch.dtype, native: bool, kernels: bool = True
) -> FusedExperts:
    """FusedExperts with random weights on the CPU, prepared as the model prepares them;
    ``native``: the fastest implementations here (the C kernel, or without it (``kernels``
    False) MKL-packed weights in fp32); else the PyTorch ops."""
    gen = torch.Generator().manual_seed(e * 100 + inter)
    layers = LayerBackend.select(CPU, dtype, native)
    if not kernels:  # MKL's packing (the model's, where torch has no oneDNN for fp32)
        gemm = packed_linear.for_dtype(CPU, dtype) if native else layers.gemm
        layers = LayerBackend(CPU, dtype, cpu=None, gemm=gemm)
    with torch.device("meta"):
        experts = FusedExperts(e, h, inter, layers)
    experts.gate_up_proj = torch.nn.Parameter(
        (0.2 * torch.randn(e, 2 * inter, h, generator=gen)).to(dtype), requires_grad=False
    )
    experts.down_proj = torch.nn.Parameter(
        (0.2 * torch.randn(e, h, inter, generator=gen)).to(dtype), requires_grad=False
    )
    if native and experts.cpu is None and isinstance(layers.gemm, Mkl):
        experts.pack(layers.gemm)
    return experts


# (tokens, experts, top_k, explicit expert ids or None for random routing)
EXPERT_CASES = [
    (1, 4, 2, None),  # a batch of one
    (2, 8, 2, [[5, 1], [1, 5]]),  # the same two experts in another order; 6 of 8 get nothing
    (3, 8, 2, [[3, 6], [3, 6], [3, 6]]),  # every token with the same experts
    (5, 6, 3, [[0, 1, 2], [0, 1, 2], [5, 4, 3], [2, 0, 1], [4, 3, 5]]),
    (17, 8, 2, None),
    (40, 16, 4, None),  # some experts likely idle, others with many tokens
    (12, 8, 2, [[3, 6]] * 12),  # two experts with more pairs than CPU_KERNEL_ROWS: their GEMMs
    (70, 8, 2, [[3, 6]] * 70),  # ... than CPU_KERNEL_ROWS_DPBF16 (bf16 with AVX512-BF16)
]


# the model's expert paths on the CPU: the C kernel (few pairs per expert) with GEMMs (more), in
# fp32 and bf16; without the kernel MKL-packed experts in fp32; F.linear on the stacked weights
# (native=False)
PATHS = [
    ("cpu_kernels", torch.float32),
    ("cpu_kernels", torch.bfloat16),
    ("mkl", torch.float32),
    ("torch", torch.float32),
    ("torch", torch.bfloat16),
]


@pytest.mark.parametrize(
    "path,dtype", PATHS, ids=["fp32-kernel", "bf16-kernel", "fp32-mkl", "fp32-torch", "bf16-torch"]
)
@pytest.mark.parametrize("case", EXPERT_CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-k{c[2]}")
def test_fused_experts_match_the_definition(case, path: str, dtype: torch.dtype) -> None:
    t, e, k, given = case
    if path != "torch":
        require(path)
    h, inter = 64, 24
    experts = experts_for(e, h, inter, dtype, path != "torch", kernels=path == "cpu_kernels")
    assert (experts.cpu is not None) == (path == "cpu_kernels")
    assert (experts.packed is not None) == (path == "mkl")
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=gen).to(dtype)
    if given is None:
        weights, ids = route(torch.randn(t, e, generator=gen), k, renormalize=False)
    else:
        ids = torch.tensor(given)
        weights = torch.rand(t, k, generator=gen)
    with torch.no_grad():
        got = experts(x, weights, ids)
        ref_experts = experts_for(e, h, inter, dtype, native=False)
        want = experts_reference(x, ref_experts.gate_up_proj, ref_experts.down_proj, weights, ids)
    assert got.shape == (t, h) and got.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    err = (got - want).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), err


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_tokens_with_identical_experts_get_identical_outputs(native: bool) -> None:
    """Two equal tokens routed to the same experts, in a step with other tokens: bit-identical
    outputs (a token's result does not depend on its position in the step)."""
    experts = experts_for(8, 64, 24, torch.float32, native=native)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(6, 64, generator=gen)
    x[4] = x[1]
    ids = torch.tensor([[0, 2], [3, 7], [7, 3], [2, 0], [3, 7], [1, 5]])
    weights = torch.rand(6, 2, generator=gen)
    weights[4] = weights[1]
    with torch.no_grad():
        out = experts(x, weights, ids)
    assert torch.equal(out[1], out[4])


# --------------------------------------------------------------------------------------------
# the models against transformers
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_dirs(tiny_model) -> dict[str, Path]:
    return {arch: tiny_model(arch, **kw) for arch, kw in MOE_ARCHS.items()}


def test_config_parsing(moe_dirs: dict[str, Path], tmp_path: Path) -> None:
    for arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM"):
        assert arch in SUPPORTED_ARCHITECTURES
    q3 = read_model_config(moe_dirs["qwen3_moe"])[0]
    assert q3.qk_norm and q3.moe is not None
    assert (q3.moe.num_experts, q3.moe.top_k, q3.moe.intermediate_size) == (8, 2, 32)
    assert q3.moe.renormalize and q3.moe.sparse_layers == (0,)  # layer 1 in mlp_only_layers
    assert q3.moe.shared_expert_intermediate_size is None
    q2 = read_model_config(moe_dirs["qwen2_moe"])[0]
    assert q2.qkv_bias and not q2.o_bias and q2.moe is not None
    assert q2.moe.sparse_layers == (1,) and not q2.moe.renormalize  # decoder_sparse_step 2
    assert q2.moe.shared_expert_intermediate_size == 48
    mx = read_model_config(moe_dirs["mixtral"])[0]
    assert mx.moe is not None and mx.moe.renormalize and mx.moe.sparse_layers == (0, 1)
    assert (mx.moe.num_experts, mx.moe.top_k, mx.moe.intermediate_size) == (4, 2, 48)
    # a hub Qwen3-MoE config says num_experts (transformers 5 writes num_local_experts)
    bad = tmp_path / "bad"
    shutil.copytree(moe_dirs["qwen3_moe"], bad)
    raw = json.loads((bad / "config.json").read_text())
    raw.pop("num_local_experts", None)
    raw |= {"num_experts": 8, "num_experts_per_tok": 9}
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelError, match="num_experts_per_tok 9 exceeds num_experts 8"):
        read_model_config(bad)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("arch", sorted(MOE_ARCHS))
def test_paged_logits_match_transformers(arch: str, native: bool, moe_dirs) -> None:
    """Chunked prefill, then decode steps, six sequences of different lengths per step."""
    if native:
        require("cpu_kernels")
        require("kernel_fp32")
    model_dir = moe_dirs[arch]
    model, info = load_model(model_dir, CPU, torch.float32, TorchAttention(native), native)
    gen = torch.Generator().manual_seed(len(arch))
    schedules = schedules_for(4)
    seqs = [torch.randint(0, info.vocab_size, (sum(c),), generator=gen).tolist() for c in schedules]
    ours = run_paged(model, seqs, schedules, 4, gen)
    for o, r in zip(ours, hf_logits(model_dir, seqs), strict=True):
        assert_close_logits(o, r)


def test_sparse_block_in_row_slices_matches_transformers(
    moe_dirs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps longer than the sparse block's row slice (1,024 tokens on the CPU) go through it
    slice by slice: routing and experts per slice, the same logits."""
    from batchgen.model.families import moe

    monkeypatch.setattr(moe, "_MOE_ROWS", 5)
    model_dir = moe_dirs["qwen2_moe"]
    model, info = load_model(model_dir, CPU, torch.float32, TorchAttention(False), native=False)
    gen = torch.Generator().manual_seed(2)
    schedules = schedules_for(4)
    seqs = [torch.randint(0, info.vocab_size, (sum(c),), generator=gen).tolist() for c in schedules]
    ours = run_paged(model, seqs, schedules, 4, gen)
    for o, r in zip(ours, hf_logits(model_dir, seqs), strict=True):
        assert_close_logits(o, r)


def test_fused_checkpoint_layout_loads_the_same_weights(moe_dirs, tmp_path: Path) -> None:
    """A checkpoint of transformers' own fused tensors (``mlp.experts.gate_up_proj`` [E, 2I, H],
    ``down_proj`` [E, H, I], router ``mlp.gate.weight``, as its state dict holds them) gives the
    same model as the per-expert layout ``save_pretrained`` writes."""
    from safetensors.torch import save_file

    from tests.hf_reference import hf_model

    for arch in ("mixtral", "qwen2_moe"):
        src = moe_dirs[arch]
        fused = tmp_path / arch
        shutil.copytree(src, fused)
        state = hf_model(src).state_dict()
        assert "model.layers.1.mlp.experts.gate_up_proj" in state
        (fused / "model.safetensors").unlink()
        save_file({k: v.contiguous() for k, v in state.items()}, fused / "model.safetensors")
        a, _ = load_model(src, CPU, torch.float32, TorchAttention(False), native=False)
        b, _ = load_model(fused, CPU, torch.float32, TorchAttention(False), native=False)
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        for name in sa:
            assert torch.equal(sa[name], sb[name]), name


# --------------------------------------------------------------------------------------------
# whole jobs through the CLI
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(MOE_ARCHS))
def test_greedy_job_matches_transformers_generate(arch: str, moe_dirs, tmp_path: Path) -> None:
    """Chunked prefill (12-token budget) with up to 3 sequences per step; transformers runs each
    prompt alone. Equal tokens, up to counted near-ties (tests/ties.py)."""
    from transformers import AutoTokenizer

    model = moe_dirs[arch]
    tok = AutoTokenizer.from_pretrained(model)
    prompts = make_prompts(6, seed=11, min_words=1, max_words=20)
    sampling = {"temperature": 0, "max_tokens": 12}
    engine = {"block_size": 4, "max_num_batched_tokens": 12, "max_num_seqs": 3}
    rows = run_job(write_job(tmp_path, model, prompts, sampling=sampling, engine=engine))
    expected = hf_greedy(model, [tok(p)["input_ids"] for p in prompts], 12)
    ref = [{"id": i, "sample_index": 0, "token_ids": e} for i, e in enumerate(expected)]
    compare_samples(rows, ref, model=model, prompts=dict(enumerate(prompts)), sampling=sampling)


def test_samples_are_the_same_with_any_batch_limits_and_the_prefix_cache(
    moe_dirs, tmp_path: Path
) -> None:
    """Seeded samples (n=3, forked from one prefill) of prompts sharing a prefix: with the prefix
    cache and batches of up to 16 sequences, and one sequence per step, 5-token steps, no prefix
    cache. The same samples (up to near-ties); the shared prefix was computed once in the first."""
    model = moe_dirs["qwen2_moe"]
    prefix = " ".join(make_prompts(1, seed=12, min_words=12, max_words=12))
    prompts = make_prompts(4, seed=13, min_words=2, max_words=8, prefix=prefix)
    sampling = {"temperature": 0.9, "max_tokens": 8, "n": 3, "seed": 5, "ignore_eos": True}
    a = samples_with_and_without_prefix_cache(tmp_path, model, prompts, sampling)
    assert len({tuple(r["token_ids"]) for r in a if r["id"] == 0}) > 1  # samples differ
    # forks: each prompt's samples computed its prompt once; the prefix cache served the
    # shared prefix to every prompt after the first
    for i in range(4):
        group = [r for r in a if r["id"] == i]
        computed = sum(r["num_prompt_tokens"] - r["num_cached_tokens"] for r in group)
        assert computed <= group[0]["num_prompt_tokens"]
    assert sum(r["num_cached_tokens"] for r in a if r["sample_index"] == 0) > 0
