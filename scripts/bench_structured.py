"""Structured outputs: their cost on workload A, and compile times (issue 17's figures).

Usage:
  python scripts/bench_structured.py [--scale 0.25] [--json bench-out/structured.json]

Runs workload A of scripts/bench.py (shared system prompt, n=4, 64 tokens, the benchmark model)
twice in one go, through the CLI: unconstrained, and with a small JSON schema (a label and a free
string, so samples run about as long as unconstrained ones; EOS is ignored in both, and a
constrained sample also ends where its grammar completes). Prints output tokens/s of both, their
ratio, and the report's mask share. Then the compile time of a 30-property schema and of 200
distinct per-row schemas, on the benchmark model's tokenizer.
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
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.yaml").write_text(json.dumps(job, indent=2))
    exe = Path(sys.executable).parent / "batchgen"
    cmd = [str(exe), "run", str(out / "job.yaml"), "--fresh", "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode != 0:
        raise SystemExit(f"batchgen failed: {proc.stderr.strip().splitlines()[-1:]}")
    report = json.loads((out / "result" / "_report.json").read_text())
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.25, help="share of workload A's rows")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    base = ROOT / "bench-out"
    model = ensure_model(base / "model", MODEL_SPECS["small"])
    w = make_workload(AutoTokenizer.from_pretrained(model), "A", args.scale)
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
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
