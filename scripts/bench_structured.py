"""Structured outputs: their cost on workload A, compile times (issue 17's figures), and the
JSON layouts on the real model (issue 32's).

Usage:
  python scripts/bench_structured.py [--scale 0.25] [--part all|workload|layouts]
                                     [--json bench-out/structured.json]

``workload``: runs workload A of scripts/bench.py (shared system prompt, n=4, 64 tokens, the
benchmark model) twice in one go, through the CLI: unconstrained, and with a small JSON schema
(a label and a free string, so samples run about as long as unconstrained ones; EOS is ignored
in both, and a constrained sample also ends where its grammar completes). Prints output tokens/s
of both, their ratio, and the report's mask share. Then the compile time of a 30-property schema
and of 200 distinct per-row schemas, on the benchmark model's tokenizer.

``layouts``: the extraction set of tests/extraction.py (60 chat prompts) on the real model
(SmolLM2-135M-Instruct, scripts/fetch_real_model.py), greedy, 48 tokens at most, CPU float32,
through the CLI: unconstrained, and with the set's JSON schema in each ``json_layout``. Prints
per job the answers that parse, the correct names / ages / cities, output tokens per sample and
output tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import MODEL_SPECS, ROOT, ensure_model, make_workload, write_parquet  # noqa: E402

SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]},
        "summary": {"type": "string"},
    },
    "required": ["label", "summary"],
    "additionalProperties": False,
}


def wide_schema(properties: int, salt: str = "") -> dict[str, Any]:
    """An object schema with ``properties`` required properties of mixed types."""
    kinds = [
        {"type": "string", "maxLength": 40},
        {"type": "integer", "minimum": 0},
        {"type": "number"},
        {"type": "boolean"},
        {"enum": ["a", "b", "c"]},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
    ]
    props = {f"{salt}field_{i}": kinds[i % len(kinds)] for i in range(properties)}
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


def run_cli(job: dict[str, Any], out: Path) -> dict[str, Any]:
    """Run ``job`` (its output folder is ``out / "result"``) through the CLI; its report."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.yaml").write_text(json.dumps(job, indent=2))
    exe = Path(sys.executable).parent / "batchgen"
    cmd = [str(exe), "run", str(out / "job.yaml"), "--fresh", "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode != 0:
        raise SystemExit(f"batchgen failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads((out / "result" / ".batchgen" / "report.json").read_text())


def run_job(model: Path, data: Path, out: Path, w: Any, structured: dict | None) -> dict:
    sampling: dict[str, Any] = {
        "n": w.n,
        "max_tokens": w.max_tokens,
        "temperature": 0.8,
        "seed": 0,
        "ignore_eos": True,
    }
    if structured is not None:
        sampling["structured"] = structured
    job = {
        "model": str(model),
        "input": {"path": str(data)},
        "output": {"path": str(out / "result")},
        "sampling": sampling,
        "engine": {"device": "cpu", "dtype": "auto"},
    }
    report = run_cli(job, out)
    return {
        "tok_s": report["output_tokens_per_s"],
        "output_tokens": report["output_tokens"],
        "elapsed_s": report["elapsed_s"],
        "structured": report.get("structured"),
    }


def compile_times(model: Path) -> dict[str, float]:
    from transformers import AutoTokenizer

    from batchgen.engine.grammar import GrammarCompiler
    from batchgen.model.registry import read_model_info

    info = read_model_info(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, info.vocab_size, info.eos_token_ids)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    compiler.json_schema(json.dumps(wide_schema(30)))
    wide = time.perf_counter() - start
    schemas = [json.dumps(wide_schema(3 + i % 8, salt=f"s{i}_")) for i in range(200)]
    start = time.perf_counter()
    for text in schemas:
        compiler.json_schema(text)
    many = time.perf_counter() - start
    return {
        "tokenizer_setup_ms": 1e3 * setup,
        "schema_30_properties_ms": 1e3 * wide,
        "schemas_200_distinct_ms": 1e3 * many,
    }


def layouts(base: Path) -> dict[str, Any]:
    """The extraction set on the real model: unconstrained and in each JSON layout."""
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq
    from fetch_real_model import fetch

    sys.path.insert(0, str(ROOT))
    from tests import extraction

    examples = extraction.examples(60)
    data = base / "extraction.parquet"
    data.parent.mkdir(parents=True, exist_ok=True)
    messages = [e.messages() for e in examples]
    table = pa.table({"id": list(range(len(examples))), "messages": messages})
    pq.write_table(table, data)
    model = fetch()
    figures: dict[str, Any] = {"rows": len(examples), "max_tokens": 48, "model": model.name}
    for name, layout in [("unconstrained", None), ("auto", "auto"), ("compact", "compact")]:
        sampling: dict[str, Any] = {"temperature": 0, "max_tokens": 48}
        if layout is not None:
            sampling["structured"] = {"json_schema": extraction.SCHEMA, "json_layout": layout}
        job = {
            "model": str(model),
            "input": {"path": str(data), "messages_column": "messages"},
            "output": {"path": str(base / name / "result")},
            "sampling": sampling,
            "engine": {"device": "cpu", "dtype": "float32"},
        }
        report = run_cli(job, base / name)
        rows = ds.dataset(base / name / "result", format="parquet").to_table().to_pylist()
        texts = [r["text"] for r in sorted(rows, key=lambda r: r["id"])]
        mask_s = (report.get("structured") or {}).get("mask_s", 0.0)
        figures[name] = {
            **extraction.score(examples, texts),
            "tokens_per_sample": report["output_tokens"] / report["samples"],
            "tok_s": report["output_tokens_per_s"],
            "elapsed_s": report["elapsed_s"],
            "mask_ms_per_token": 1e3 * mask_s / max(report["output_tokens"], 1),
        }
        if layout is not None:
            tokens = [r["token_ids"] for r in rows]
            figures[name]["replay_us_per_mask"] = replay_masks(model, layout, tokens)
        f = figures[name]
        replay = f.get("replay_us_per_mask")
        print(
            f"{name:>13}: {f['parsed']}/{len(examples)} parse, name/age/city "
            f"{f['name']}/{f['age']}/{f['city']}, {f['tokens_per_sample']:.1f} tokens per "
            f"sample, {f['tok_s']:.0f} tok/s ({f['elapsed_s']:.1f} s), masks "
            f"{f['mask_ms_per_token']:.2f} ms per token in the job"
            + (f", {replay:.1f} us per mask replayed" if replay is not None else ""),
            flush=True,
        )
    return figures


def replay_masks(model: Path, layout: str, samples: list[list[int]]) -> float:
    """Microseconds per mask of the extraction schema in ``layout``, replaying the samples'
    tokens (fill the mask, consume the token) on one thread; best of 3. Unlike the job's
    ``mask_s`` (which also unpacks the masks onto the logits, with torch's threads), it is
    the grammar's own cost per token."""
    import torch

    from batchgen.engine.grammar import GrammarCompiler
    from batchgen.model.loader import load_tokenizer
    from batchgen.model.registry import read_model_info
    from tests import extraction

    info = read_model_info(model)
    compiler = GrammarCompiler(load_tokenizer(model), info.vocab_size, info.eos_token_ids)
    grammar = compiler.json_schema(json.dumps(extraction.SCHEMA), layout)
    words = torch.empty((info.vocab_size + 31) // 32, dtype=torch.int32)
    count = sum(len(s) for s in samples)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for sample in samples:
            matcher = grammar.start()
            for token in sample:
                matcher.fill_mask(words)
                matcher.consume(token)
        best = min(best, time.perf_counter() - start)
    return 1e6 * best / max(count, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.25, help="share of workload A's rows")
    parser.add_argument("--part", choices=["all", "workload", "layouts"], default="all")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    figures: dict[str, Any] = {}
    if args.part in ("all", "workload"):
        figures.update(workload(args.scale))
    if args.part in ("all", "layouts"):
        print("[bench] JSON layouts on the real model, extraction set", flush=True)
        figures["layouts"] = layouts(ROOT / "bench-out" / "structured" / "layouts")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2))


def workload(scale: float) -> dict[str, Any]:
    """Workload A unconstrained and with a small schema, and compile times (issue 17)."""
    from transformers import AutoTokenizer

    base = ROOT / "bench-out"
    model = ensure_model(base / "model", MODEL_SPECS["small"])
    w = make_workload(AutoTokenizer.from_pretrained(model), "A", scale)
    data = base / "structured" / "A.parquet"
    write_parquet(w, data)
    print(f"[bench] workload A: {w.rows} rows, n={w.n}, max_tokens={w.max_tokens}", flush=True)
    free = run_job(model, data, base / "structured" / "free", w, None)
    constrained = run_job(
        model, data, base / "structured" / "json", w, {"json_schema": SMALL_SCHEMA}
    )
    figures = {
        "workload": "A",
        "rows": w.rows,
        "unconstrained": free,
        "json_schema": constrained,
        "throughput_ratio": constrained["tok_s"] / free["tok_s"],
        "compile": compile_times(model),
    }
    s = constrained["structured"]
    print(
        f"unconstrained: {free['tok_s']:.0f} tok/s\n"
        f"json schema:   {constrained['tok_s']:.0f} tok/s "
        f"({100 * figures['throughput_ratio']:.0f}% of unconstrained), mask share "
        f"{100 * s['mask_share']:.1f}%, {s['complete_samples']} of {s['constrained_samples']} "
        "samples complete"
    )
    c = figures["compile"]
    print(
        f"compile: tokenizer {c['tokenizer_setup_ms']:.0f} ms, 30-property schema "
        f"{c['schema_30_properties_ms']:.1f} ms, 200 distinct schemas "
        f"{c['schemas_200_distinct_ms']:.0f} ms"
    )
    return figures


if __name__ == "__main__":
    main()
