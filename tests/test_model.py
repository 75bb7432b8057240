"""Model, attention and loader tests: parity with transformers on tiny random models.

Our model runs over a paged KV cache (random block tables, unused blocks filled with NaN), with
prompts computed in two chunks and then single-token decode steps, several sequences of different
lengths in one batch; its logits must equal transformers' teacher-forced logits in fp32.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from batchgen.errors import ModelError
from batchgen.kernels.reference import paged_attention_ref
from batchgen.model.attention import (
    AttentionMetadata,
    TorchAttention,
)
from batchgen.model.loader import (
    load_model,
    load_tokenizer,
    model_identity,
)
from batchgen.model.registry import read_model_config, read_model_info
from batchgen.tiny_model import (
    END_OF_TURN_ID,
    EOS_ID,
    make_tiny_model,
    make_words,
    write_prompts_parquet,
)
from tests.hf_reference import hf_logits
from tests.jobkit import copy_model
from tests.optional import require

CPU = torch.device("cpu")

# name -> (make_tiny_model kwargs, block size). Together they cover GQA, MHA and MQA, a head_dim
# that is not hidden/heads, tied and untied embeddings, a sharded checkpoint, Qwen2's q/k/v bias
# and Qwen3's q/k norms.
CASES: dict[str, tuple[dict, int]] = {
    "llama": (dict(arch="llama", num_heads=4, num_kv_heads=2, head_dim=24, sharded=True), 4),
    "mistral": (dict(arch="mistral", num_heads=4, num_kv_heads=4, tie_word_embeddings=True), 16),
    "qwen2": (dict(arch="qwen2", num_heads=4, num_kv_heads=1, tie_word_embeddings=True), 4),
    "qwen3": (dict(arch="qwen3", num_heads=8, num_kv_heads=2, head_dim=16), 16),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: make_tiny_model(root / name, **kw) for name, (kw, _) in CASES.items()}


def new_cache(model, num_blocks: int, block_size: int) -> torch.Tensor:
    cfg = model.cfg
    shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    dtype = model.embed_tokens.weight.dtype
    return torch.full(shape, float("nan"), dtype=dtype)  # a stray read of a free slot shows


def run_paged(
    model,
    seqs: list[list[int]],
    schedules: list[list[int]],
    block_size: int,
    gen: torch.Generator,
    shared: dict[int, tuple[int, int]] | None = None,
) -> list[torch.Tensor]:
    """Teacher-forced logits of each sequence ``[len, vocab]``: step s feeds every sequence its
    next chunk ``schedules[b][s]`` (if any) through the paged cache with random block tables.

    ``shared[b] = (a, n)``: sequence b starts with the first n blocks of sequence a (the same
    tokens, computed by a in an earlier step) and only computes the rest; its logits rows for
    that prefix stay NaN.
    """
    shared = shared or {}
    lens = [len(s) for s in seqs]
    skip = {b: n * block_size for b, (_, n) in shared.items()}
    assert [sum(c) + skip.get(b, 0) for b, c in enumerate(schedules)] == lens
    need = [math.ceil(n / block_size) - shared.get(b, (0, 0))[1] for b, n in enumerate(lens)]
    num_blocks = sum(need) + 6
    # block 0 (the block-table padding value) and a few others are never allocated: all NaN
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, start = [], 0
    for n in need:
        tables.append(perm[start : start + n])
        start += n
    for b, (a, n) in shared.items():
        assert seqs[b][: n * block_size] == seqs[a][: n * block_size]
        tables[b] = tables[a][:n] + tables[b]
    kv_cache = new_cache(model, num_blocks, block_size)

    out = [torch.full((n, model.cfg.vocab_size), float("nan")) for n in lens]
    done = [skip.get(b, 0) for b in range(len(seqs))]
    for step in range(max(len(c) for c in schedules)):
        active = [b for b in range(len(seqs)) if step < len(schedules[b]) and schedules[b][step]]
        ids, pos, slots, cu, seq_lens = [], [], [], [0], []
        for b in active:
            chunk = schedules[b][step]
            p = list(range(done[b], done[b] + chunk))
            ids += seqs[b][done[b] : done[b] + chunk]
            pos += p
            slots += [tables[b][i // block_size] * block_size + i % block_size for i in p]
            cu.append(cu[-1] + chunk)
            seq_lens.append(done[b] + chunk)
        max_blocks = max(len(t) for t in tables)
        bt = torch.zeros(len(active), max_blocks, dtype=torch.int32)
        for row, b in enumerate(active):
            valid = math.ceil(seq_lens[row] / block_size)
            bt[row, :valid] = torch.tensor(tables[b][:valid])
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=bt,
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            max_seqlen_q=max(cu[i + 1] - cu[i] for i in range(len(active))),
            max_seqlen_k=max(seq_lens),
        )
        with torch.no_grad():
            hidden = model(torch.tensor(ids), torch.tensor(pos), kv_cache, meta)
            logits = model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (len(ids), model.cfg.vocab_size)
        for row, b in enumerate(active):
            chunk = schedules[b][step]
            out[b][done[b] : done[b] + chunk] = logits[cu[row] : cu[row + 1]]
            done[b] += chunk
    return out


def schedules_for(block_size: int) -> list[list[int]]:
    """Two prompt chunks, then decode steps; lengths 1 and exact multiples of the block size."""
    bs = block_size
    return [
        [1, 1, 1, 1],  # a one-token prompt, decoding while the others prefill
        [bs, bs, 1, 1, 1],  # prompt of exactly two blocks
        [5, 8, 1, 1, 1, 1],
        [bs - 1, 1, 1, 1],  # ends on a block boundary after the first decode
        [3 * bs + 2, 3, 1, 1, 1],  # long cached prefix, short second chunk
        [2, 2 * bs + 5, 1, 1],  # short prefix, long second chunk
    ]


def assert_close_logits(ours: torch.Tensor, ref: torch.Tensor) -> None:
    computed = ~ours.isnan().all(-1)  # rows of a shared prefix are not computed
    ours, ref = ours[computed], ref[computed]
    assert len(ours) and torch.isfinite(ours).all()
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4 * max(scale, 1.0), f"max abs err {err:.3g} at logit scale {scale:.3g}"


def load(model_dir: Path, native: bool, dtype: torch.dtype = torch.float32):
    """Our model with the C kernels and pre-packed GEMM weights on (the test fails where they
    cannot be: tests/optional.py) or off everywhere (attention, RMSNorm, RoPE, SwiGLU,
    ``F.linear``: the pure-PyTorch path)."""
    if native:
        require("cpu_kernels")
        require("kernel_fp32")
    return load_model(model_dir, CPU, dtype, TorchAttention(native=native), native=native)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("name", list(CASES))
def test_paged_logits_match_transformers(
    name: str, native: bool, model_dirs: dict[str, Path]
) -> None:
    kw, block_size = CASES[name]
    model_dir = model_dirs[name]
    model, info = load(model_dir, native)
    gen = torch.Generator().manual_seed(len(name))
    schedules = schedules_for(block_size)
    seqs = [torch.randint(0, info.vocab_size, (sum(c),), generator=gen).tolist() for c in schedules]
    ours = run_paged(model, seqs, schedules, block_size, gen)
    for o, r in zip(ours, hf_logits(model_dir, seqs), strict=True):
        assert_close_logits(o, r)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_mlp_in_row_slices_matches_transformers(
    native: bool, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps longer than the MLP's row slice (1024 on the CPU) go through it slice by slice."""
    from batchgen.model.families import llama

    monkeypatch.setattr(llama, "_MLP_ROWS", 5)
    model, info = load(model_dirs["llama"], native)
    gen = torch.Generator().manual_seed(3)
    schedules = schedules_for(CASES["llama"][1])
    seqs = [torch.randint(0, info.vocab_size, (sum(c),), generator=gen).tolist() for c in schedules]
    ours = run_paged(model, seqs, schedules, CASES["llama"][1], gen)
    for o, r in zip(ours, hf_logits(model_dirs["llama"], seqs), strict=True):
        assert_close_logits(o, r)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_shared_prefix_blocks_match_transformers(
    native: bool, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequences that reuse another's cached prefix blocks (prefix cache, forks); with the
    cascade threshold at 0, their decode and extend steps go through the cascade path."""
    from batchgen.model.attention import torch_plan

    monkeypatch.setattr(torch_plan, "_CASCADE_MIN_SAVED", 0)
    model, info = load(model_dirs["llama"], native)
    gen = torch.Generator().manual_seed(5)
    bs = 4
    prefix = torch.randint(0, info.vocab_size, (3 * bs + 1,), generator=gen).tolist()
    tails = [torch.randint(0, info.vocab_size, (n,), generator=gen).tolist() for n in (4, 7, 5, 9)]
    seqs = [prefix + t for t in tails]
    schedules = [
        [15, 1, 1],  # computes the prefix blocks, then decodes
        [0, 5, 1, 1, 1],  # after it: the 13th prefix token and its own tail, then decodes
        [0, 1, 1, 1, 1, 1, 1],  # decodes from the first step after the shared blocks
        [0, 3, 2, 3, 2, 4],  # small extend chunks
    ]
    shared = {1: (0, 3), 2: (0, 3), 3: (0, 2)}
    ours = run_paged(model, seqs, schedules, bs, gen, shared=shared)
    for o, r in zip(ours, hf_logits(model_dirs["llama"], seqs), strict=True):
        assert_close_logits(o, r)


def greedy(model, prompts: list[list[int]], max_new: int, eos: set[int]) -> list[list[int]]:
    """Our model alone: batched prefill of every prompt, then batched greedy decode steps."""
    block_size = 8
    need = [math.ceil((len(p) + max_new) / block_size) for p in prompts]
    kv_cache = new_cache(model, sum(need) + 1, block_size)
    tables, start = [], 1
    for n in need:
        tables.append(list(range(start, start + n)))
        start += n
    seqs = [list(p) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    new = [list(p) for p in prompts]  # tokens to feed this step
    while True:
        active = [b for b in range(len(seqs)) if new[b]]
        if not active:
            return outs
        ids, pos, slots, cu = [], [], [], [0]
        for b in active:
            first = len(seqs[b]) - len(new[b])
            p = list(range(first, len(seqs[b])))
            ids += new[b]
            pos += p
            slots += [tables[b][i // block_size] * block_size + i % block_size for i in p]
            cu.append(cu[-1] + len(new[b]))
        lens = [len(seqs[b]) for b in active]
        bt = torch.tensor([tables[b] + [0] * (max(need) - len(tables[b])) for b in active])
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            block_tables=bt.to(torch.int32),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            max_seqlen_q=max(len(new[b]) for b in active),
            max_seqlen_k=max(lens),
        )
        with torch.no_grad():
            hidden = model(torch.tensor(ids), torch.tensor(pos), kv_cache, meta)
            last = hidden[torch.tensor(cu[1:]) - 1]
            next_ids = model.compute_logits(last).argmax(-1).tolist()
        for b, tok in zip(active, next_ids, strict=True):
            outs[b].append(tok)
            seqs[b].append(tok)
            done = tok in eos or len(outs[b]) >= max_new
            new[b] = [] if done else [tok]


def test_greedy_matches_transformers_generate(model_dirs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = model_dirs["qwen3"]
    model, info = load_model(model_dir, CPU, torch.float32, TorchAttention())
    tok = load_tokenizer(model_dir)
    prompts = [tok(" ".join(make_words(n, seed=n)))["input_ids"] for n in (3, 11)]
    ours = greedy(model, prompts, max_new=12, eos=set(info.eos_token_ids))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=12, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert got == ref


@pytest.mark.parametrize("hq,hkv,block_size", [(4, 2, 4), (3, 3, 16), (8, 1, 8)])
@pytest.mark.parametrize(
    "tuning,native",
    [("default", True), ("split", True), ("default", False), ("split", False), ("merge", False),
     ("no_flash_op", False)],
)  # fmt: skip
def test_torch_attention_matches_reference(
    hq: int,
    hkv: int,
    block_size: int,
    tuning: str,
    native: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Mixed batches through every path: decode, fresh prefill, extend, padded groups, and
    cascades over shared prefix blocks (some members sharing more blocks than the cascade's);
    unused cache blocks are NaN.
    ``native``: every sequence and every cascade prefix in the C kernels (reading the paged
    cache in place), per token or tiled."""
    from batchgen.model.attention import torch_backend, torch_plan

    if native:
        require("cpu_kernels")

    if tuning != "default":
        monkeypatch.setattr(torch_plan, "_CASCADE_MIN_SAVED", 0)  # any shared block: a cascade
        monkeypatch.setattr(torch_plan, "_GROUP_OVERHEAD", 0 if tuning == "split" else 10**9)
    if tuning == "no_flash_op":  # the log-sum-exp path used off the CPU
        monkeypatch.setattr(torch_backend, "_flash_cpu", None)
    gen = torch.Generator().manual_seed(hq * 100 + block_size)
    d, bs = 8, block_size
    pools = {"a": 3, "b": 1, "c": 2}  # shared prefixes, in blocks ("c" follows "a")
    # (new tokens, cached tokens, shared prefix pools): decodes of different lengths, fresh
    # prefills, chunks after a cached prefix, a long sequence, and sequences sharing a prefix,
    # some of them a longer one (a, then c)
    specs = [
        (1, 0, ()), (1, 7, ()), (1, 16, ()), (1, 300, ()), (5, 0, ()), (16, 0, ()),
        (40, 0, ()), (3, 13, ()), (9, 32, ()), (2, 200, ()),
        (1, 3 * bs + 5, ("a",)), (1, 3 * bs, ("a",)), (4, 3 * bs + 2, ("a",)),
        (1, 3 * bs + 20, ("a",)), (1, bs + 1, ("b",)), (3, bs, ("b",)),
        (1, 5 * bs + 3, ("a", "c")), (2, 5 * bs + 1, ("a", "c")), (1, 5 * bs, ("a", "c")),
    ]  # fmt: skip
    shared = [sum(pools[p] for p in ps) for _, _, ps in specs]
    own = [math.ceil((q + c) / bs) - shared[b] for b, (q, c, _) in enumerate(specs)]
    num_blocks = sum(own) + sum(pools.values()) + 3
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    pool_blocks = {}
    for name, n in pools.items():
        pool_blocks[name], perm = perm[:n], perm[n:]
    kv_cache = torch.full((1, 2, num_blocks, bs, hkv, d), float("nan"))  # one layer
    k_cache, v_cache = kv_cache[0, 0], kv_cache[0, 1]
    k_flat, v_flat = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    for blocks in pool_blocks.values():  # a shared prefix is written once
        for blk in blocks:
            k_flat[blk * bs : (blk + 1) * bs] = torch.randn(bs, hkv, d, generator=gen)
            v_flat[blk * bs : (blk + 1) * bs] = torch.randn(bs, hkv, d, generator=gen)
    tables = []
    for b, (_, _, ps) in enumerate(specs):
        mine, perm = perm[: own[b]], perm[own[b] :]
        tables.append([blk for p in ps for blk in pool_blocks[p]] + mine)
    bt = torch.zeros(len(specs), max(len(t) for t in tables), dtype=torch.int32)
    slots, cu = [], [0]
    for b, (q_len, cached, _) in enumerate(specs):
        table = tables[b]
        bt[b, : len(table)] = torch.tensor(table)
        for i in range(shared[b] * bs, cached):  # the rest of the cached part
            s = table[i // bs] * bs + i % bs
            k_flat[s] = torch.randn(hkv, d, generator=gen)
            v_flat[s] = torch.randn(hkv, d, generator=gen)
        slots += [table[i // bs] * bs + i % bs for i in range(cached, cached + q_len)]
        cu.append(cu[-1] + q_len)
    t = cu[-1]
    q = torch.randn(t, hq, d, generator=gen)
    k = torch.randn(t, hkv, d, generator=gen)
    v = torch.randn(t, hkv, d, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=bt,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor([q + c for q, c, _ in specs], dtype=torch.int32),
        max_seqlen_q=max(q for q, _, _ in specs),
        max_seqlen_k=max(q + c for q, c, _ in specs),
    )
    backend = TorchAttention(native=native)
    plan = backend.prepare(meta, kv_cache, hq)
    out = backend.forward(q, k, v, k_cache, v_cache, plan, 0.3)
    assert (plan.kernels is not None) == native
    if native:  # every sequence went to a kernel: few query rows per token, else tiled
        assert plan.native_seqs is not None and plan.tiled_seqs is not None and not plan.groups
        tiled = [b for b, (q, _, _) in enumerate(specs) if q * (hq // hkv) >= 16]
        assert plan.tiled_seqs.tolist() == tiled
        assert sorted(plan.native_seqs.tolist() + tiled) == list(range(len(specs)))
    else:
        assert len(plan.groups) >= 3 and plan.native_seqs is None
    if tuning != "default" and native:  # a (its members' c blocks are their own keys) and b
        assert plan.cascade_batch is not None and not plan.cascades
        assert plan.cascade_batch.slot_offsets.tolist() == [0, 3 * bs, 4 * bs]
    elif tuning != "default":
        assert len(plan.cascades) == 2 and plan.cascade_batch is None
    # a second layer runs the same plan
    kv_cache2 = kv_cache.clone()
    out2 = backend.forward(q, k, v, kv_cache2[0, 0], kv_cache2[0, 1], plan, 0.3)
    ref = paged_attention_ref(
        q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, 0.3,
        meta.max_seqlen_q, meta.max_seqlen_k,
    )  # fmt: skip
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out2, out)


# Llama 3.1-style scaling, with an original context (64) the tests' sequences run past
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
}


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
        LLAMA31_ROPE,
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "rope_theta": 10000.0,
        },
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_scaling_matches_transformers(rope: dict, tmp_path: Path) -> None:
    model_dir = make_tiny_model(
        tmp_path / "m", "llama", num_layers=1, config_overrides={"rope_parameters": rope}
    )
    model, info = load_model(model_dir, CPU, torch.float32, TorchAttention())
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, info.vocab_size, (300,), generator=gen).tolist()
    (ours,) = run_paged(model, [seq], [[200, 100]], 16, gen)
    assert_close_logits(ours, hf_logits(model_dir, [seq])[0])


def test_gguf_rope_frequency_factors_match_transformers(tmp_path: Path) -> None:
    """Llama 3.1-style RoPE scaling as llama.cpp stores it in a GGUF file (per-pair divisors,
    rope_freqs.weight), against transformers running the original folder (its own GGUF reader
    ignores rope_freqs): logits past the original context length (64)."""
    from tests.gguf_files import write_gguf

    model_dir = make_tiny_model(
        tmp_path / "m", "llama", num_layers=1, config_overrides={"rope_parameters": LLAMA31_ROPE}
    )
    path = write_gguf(model_dir, tmp_path / "llama31.gguf")
    model, info = load_model(path, CPU, torch.float32, TorchAttention())
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, info.vocab_size, (300,), generator=gen).tolist()
    (ours,) = run_paged(model, [seq], [[200, 100]], 16, gen)
    assert_close_logits(ours, hf_logits(model_dir, [seq])[0])


def test_config_parsing(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    from batchgen.model.registry import read_model_config

    copy = shutil.copytree(model_dirs["llama"], tmp_path / "legacy")
    base = json.loads((copy / "config.json").read_text())

    def parse(**changes):
        cfg = {k: v for k, v in base.items() if k not in ("rope_parameters", "head_dim")}
        cfg.update(changes)
        (copy / "config.json").write_text(json.dumps(cfg))
        return read_model_config(copy)[0]

    # transformers-4 style: top-level rope_theta, rope_scaling with "type" or "rope_type"
    cfg = parse(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor) == ("linear", 500000.0, 2.0)
    assert cfg.head_dim == 64 // 4  # no head_dim: hidden / heads
    llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    cfg = parse(rope_theta=500000.0, rope_scaling=llama31)
    assert cfg.rope.rope_type == "llama3" and cfg.rope.original_max_position_embeddings == 8192
    assert parse().rope.rope_type == "default"
    with pytest.raises(ModelError, match="unsupported rope type 'proportional'"):
        parse(rope_scaling={"rope_type": "proportional", "factor": 2.0})
    with pytest.raises(ModelError, match="longrope needs short_factor and long_factor"):
        parse(rope_scaling={"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(ModelError, match="'hidden_size' must be a positive integer"):
        parse(hidden_size=None)
    with pytest.raises(ModelError, match="not a multiple of num_key_value_heads"):
        parse(num_key_value_heads=3)


def test_bfloat16_forward_runs(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 weights and cache on the CPU, through the decode, extend and cascade paths."""
    from batchgen.model.attention import torch_plan

    monkeypatch.setattr(torch_plan, "_CASCADE_MIN_SAVED", 0)
    model_dir = model_dirs["qwen3"]
    model, info = load_model(model_dir, CPU, torch.bfloat16, TorchAttention())
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, info.vocab_size, (40,), generator=gen).tolist()
    seqs = [
        prefix + torch.randint(0, info.vocab_size, (n,), generator=gen).tolist() for n in (3, 9)
    ]
    ref = hf_logits(model_dir, seqs)
    ours = run_paged(
        model, seqs, [[40, 1, 1, 1], [0, 12, 1, 1, 1, 1, 1]], 16, gen, shared={1: (0, 2)}
    )
    for o, r in zip(ours, ref, strict=True):
        rows = ~o.isnan().all(-1)
        assert torch.isfinite(o[rows]).all()
        # bf16 end to end: loose agreement with the fp32 reference
        assert torch.nn.functional.cosine_similarity(o[rows], r[rows], dim=-1).min() > 0.995


def test_model_info_and_identity(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    info = read_model_info(model_dirs["llama"])
    assert info.architecture == "LlamaForCausalLM"
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (2, 4, 2, 24)
    assert (info.hidden_size, info.vocab_size, info.max_model_len) == (64, 512, 512)
    assert info.eos_token_ids == (EOS_ID, END_OF_TURN_ID)
    assert info.kv_bytes_per_token(torch.float32) == 2 * 2 * 2 * 24 * 4
    assert info.kv_bytes_per_token(torch.bfloat16) == 2 * 2 * 2 * 24 * 2

    # a Mistral sliding window below max_position_embeddings no longer caps the usable length
    copy = shutil.copytree(model_dirs["mistral"], tmp_path / "mistral")
    cfg = json.loads((copy / "config.json").read_text())
    ident = model_identity(copy)
    assert ident == model_identity(model_dirs["mistral"])  # content, not path
    cfg["sliding_window"] = 128
    (copy / "config.json").write_text(json.dumps(cfg))
    assert read_model_info(copy).max_model_len == 512
    assert read_model_config(copy)[0].windows == (128, 128)
    assert model_identity(copy) != ident


def test_tiny_model_round_trip(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    tok = load_tokenizer(model_dirs["llama"])
    text = " ".join(make_words(20, seed=3))
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) < len(text)
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.eos_token_id == EOS_ID
    assert max(ids) < read_model_info(model_dirs["llama"]).vocab_size
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "kaba lomi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<s><|user|>\nkaba lomi<|end|>\n<|assistant|>\n"
    assert make_words(50, seed=1) == make_words(50, seed=1) != make_words(50, seed=2)

    table = pq.read_table(write_prompts_parquet(tmp_path / "p.parquet", 10, seed=1))
    assert table.column_names == ["id", "prompt"] and table.num_rows == 10
    assert table.column("id").to_pylist() == list(range(10))


# ---------------------------------------------------------------------------------- errors


def test_loader_errors(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    backend = TorchAttention()

    def load(path: Path) -> None:
        load_model(path, CPU, torch.float32, backend)

    with pytest.raises(ModelError, match="model folder not found"):
        load(tmp_path / "nowhere")

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError, match="config.json not found"):
        load(empty)

    bad_json = copy_model(model_dirs["mistral"], tmp_path, "bad_json")
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="invalid config.json"):
        load(bad_json)

    gpt2 = copy_model(model_dirs["mistral"], tmp_path, "gpt2")
    cfg = json.loads((gpt2 / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (gpt2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="unsupported architecture GPT2LMHeadModel") as err:
        read_model_info(gpt2)
    assert str(err.value).endswith(
        "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
        "Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM, Gemma2ForCausalLM, "
        "Gemma3ForCausalLM, Phi3ForCausalLM, GptOssForCausalLM"
    )

    no_weights = copy_model(model_dirs["mistral"], tmp_path, "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="no weights"):
        load(no_weights)

    truncated = copy_model(model_dirs["mistral"], tmp_path, "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(
        ModelError, match="corrupt or truncated safetensors file .*model.safetensors"
    ):
        load(truncated)

    from safetensors.torch import load_file, save_file

    missing = copy_model(model_dirs["mistral"], tmp_path, "missing")
    tensors = load_file(missing / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, missing / "model.safetensors")
    with pytest.raises(ModelError, match="tensor model.layers.1.mlp.up_proj.weight missing"):
        load(missing)

    bad_shard = copy_model(model_dirs["llama"], tmp_path, "bad_shard")
    next(bad_shard.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ModelError, match="weight shard .* not found"):
        load(bad_shard)

    no_tok = copy_model(model_dirs["mistral"], tmp_path, "no_tok")
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match="no tokenizer"):
        load_tokenizer(no_tok)

    for err_dir in (gpt2, truncated, missing):
        with pytest.raises(ModelError) as info:
            load(err_dir)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "native,dtype", [(True, torch.float32), (False, torch.float32), (True, torch.bfloat16)]
)
def test_layer_implementations_are_chosen_at_load(
    native: bool, dtype: torch.dtype, model_dirs: dict[str, Path]
) -> None:
    """Each layer is built with its implementation: on a CPU the C kernels (fp32 and bf16) with
    batchgen's own GEMM in fp32 and AVX512-BF16 or oneDNN-packed ones in bf16; without them
    torch's fused RMSNorm in fp32 and the HF formula in half precision."""
    from batchgen.model.kernel_linear import KernelGemm
    from batchgen.model.layers.activation import CpuSiluMul, silu_mul_
    from batchgen.model.layers.linear import KernelLinear, Linear, OneDnnLinear
    from batchgen.model.layers.norm import CpuRMSNorm, FusedRMSNorm, RMSNorm
    from batchgen.model.layers.rotary import CpuRope, rope_

    if native and dtype == torch.bfloat16:
        require("onednn")
    model, _ = load(model_dirs["qwen3"], native, dtype)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    norm_type = CpuRMSNorm if native else FusedRMSNorm if dtype == torch.float32 else RMSNorm
    norms = [model.norm, model.layers[0].input_layernorm, attn.q_norm, attn.k_norm]
    assert all(type(n) is norm_type for n in norms)
    assert isinstance(attn.rope_, CpuRope) if native else attn.rope_ is rope_
    assert isinstance(mlp.silu_mul_, CpuSiluMul) if native else mlp.silu_mul_ is silu_mul_
    # fp32: the C kernels' GEMM (load() requires it); bf16: the AVX512-BF16 GEMM where the CPU
    # has it and no AMX, else oneDNN
    bf16_layer = KernelLinear if isinstance(model.layer_backend.gemm, KernelGemm) else OneDnnLinear
    packed = (KernelLinear if dtype == torch.float32 else bf16_layer) if native else Linear
    assert type(attn.qkv_proj) is packed
