"""OpenVINO GenAI's side of scripts/bench.py: one workload through a ContinuousBatchingPipeline.

Run by bench.py in OpenVINO's own venv (docs/performance.md has the recipe), never by hand:

  .venv-openvino/bin/python scripts/bench_openvino_worker.py SPEC.json

SPEC.json (written by bench.py): ``model`` (an OpenVINO IR folder exported by optimum-intel, with
its tokenizer and detokenizer), ``data`` (the workload's Parquet file, column ``prompt``), ``n``,
``max_tokens``, ``temperature``, ``seed``, ``properties`` (the CPU plugin's: inference precision,
KV cache precision, threads), ``cache_size_gb``, ``runs`` (where each run's JSON line is appended)
and ``result`` (where the JSON result goes, at the end). The worker makes one run per line it reads
on stdin (bench.py gives batchgen and the peers runs in turn, keeping this process up between
them) and ends at the end of its input. Per run a fresh pipeline is built (so the prefix cache
starts empty; not timed) and warmed up with a few short prompts (not timed); then the workload's prompts, tokenized by the
pipeline's own tokenizer (the same strings as the other systems get, no chat template), go to ONE
``generate`` call, which batches them continuously. The timed span is tokenization, ``generate``
and detokenization (the work of ``generate`` on strings, which returns no token ids to count).

Imports only the standard library, openvino_genai and pyarrow.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import openvino_genai as ov_genai
import pyarrow.parquet as pq


def build_pipeline(spec: dict[str, Any]) -> Any:
    sched = ov_genai.SchedulerConfig()
    sched.enable_prefix_caching = True
    sched.cache_size = int(spec.get("cache_size_gb", 4))  # GB of KV cache
    # dynamic_split_fuse, max_num_batched_tokens and max_num_seqs: the library's defaults
    return ov_genai.ContinuousBatchingPipeline(
        spec["model"], sched, "CPU", dict(spec["properties"])
    )


def generation_config(n: int, max_tokens: int, temperature: float, seed: int) -> Any:
    cfg = ov_genai.GenerationConfig()
    cfg.num_return_sequences = n
    cfg.max_new_tokens = max_tokens
    cfg.min_new_tokens = max_tokens
    cfg.ignore_eos = True
    cfg.do_sample = True  # multinomial sampling, no top-k / top-p (their defaults: off)
    cfg.temperature = temperature
    cfg.rng_seed = seed
    cfg.apply_chat_template = False
    return cfg


def run_once(pipe: Any, prompts: list[str], spec: dict[str, Any]) -> dict[str, Any]:
    """One timed pass over ``prompts``: tokenize, generate (one call), detokenize."""
    n, max_tokens = spec["n"], spec["max_tokens"]
    cfg = generation_config(n, max_tokens, spec["temperature"], spec["seed"])
    tok = pipe.get_tokenizer()
    t = time.perf_counter()
    ids = [tok.encode(p).input_ids for p in prompts]
    results = pipe.generate(ids, [cfg] * len(ids))
    samples = [list(s) for r in results for s in r.m_generation_ids]
    tok.decode(samples)
    elapsed = time.perf_counter() - t
    tokens = sum(len(s) for s in samples)
    return {
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "tok_s": tokens / elapsed,
        "samples": len(samples),
        "missing_samples": len(prompts) * n - len(samples),
        "short_samples": sum(1 for s in samples if len(s) != max_tokens),
        "prompt_tokens": sum(int(x.get_shape()[-1]) for x in ids),
    }


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    prompts = pq.read_table(spec["data"]).column("prompt").to_pylist()
    warm = generation_config(2, 8, spec["temperature"], spec["seed"])
    warm_prompts = ["hello world " * k for k in range(1, 5)]
    runs, startup = [], []
    for _ in sys.stdin:  # one run per line from bench.py (its PeerWorker), until end of input
        t = time.perf_counter()
        pipe = build_pipeline(spec)
        startup.append(time.perf_counter() - t)
        pipe.generate(warm_prompts, [warm] * len(warm_prompts))
        runs.append(run_once(pipe, prompts, spec))
        runs[-1]["startup_s"] = startup[-1]
        with open(spec["runs"], "a") as f:  # what bench.py waits for
            f.write(json.dumps(runs[-1]) + "\n")
        del pipe
    result = {
        "startup_s": startup[0] if startup else None,
        "runs": runs,
        "openvino_genai_version": ov_genai.__version__,
        "properties": spec["properties"],
        "cache_size_gb": spec.get("cache_size_gb", 4),
    }
    Path(spec["result"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
