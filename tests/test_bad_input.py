"""Bad input never crashes a job and never loses results, end to end through the CLI.

- A problem with the job file, a ``--set``, the model folder, the input or the output folder exits
  2 with ONE line on stderr that names the key / file / column, never a traceback; ``validate``
  reports the same problems as ``run``.
- A bad row becomes ``n`` error rows and costs the good rows nothing: they come out exactly as in
  a job without the bad rows.
- A bug exits 1 with one line naming a log that holds the traceback; what was committed stays
  valid and a resume completes the job.

The unit tests of job.py, dataset.py, results.py and the CLI cover the messages in detail; here
every case goes through ``batchgen run`` / ``batchgen validate`` as a user would meet it.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import Result

from batchgen.tiny_model import CHAT_TEMPLATE, make_prompts, make_words
from tests.jobkit import copy_model, invoke, one_line, read_results, write_job_file
from tests.ties import compare_samples

ARCH = dict(num_heads=4, num_kv_heads=2, head_dim=24)  # the llama of test_e2e: made once
# Plain seeds throughout: runs are compared with tests.ties.compare_samples, so any seed must pass.
PROMPTS = make_prompts(4, seed=0, min_words=3, max_words=10)
SAMPLING = {"temperature": 0, "max_tokens": 4}
ENGINE = {"kv_cache_blocks": 128, "block_size": 4}


def _permissions_apply() -> bool:
    """Whether a mode of 0 keeps this process out (not for root, unless it dropped the
    capabilities that let it in)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        probe = Path(d) / "probe"
        probe.write_text("x")
        probe.chmod(0)
        try:
            probe.read_text()
        except PermissionError:
            return True
        return False


PERMISSIONS_APPLY = _permissions_apply()


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("llama", **ARCH)


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


# --------------------------------------------------------------------------- helpers


def no_traceback(result: Result) -> None:
    assert "Traceback" not in result.stdout, result.stdout
    assert "Traceback" not in result.stderr, result.stderr


def base_job(model: Path) -> dict[str, Any]:
    return {
        "model": str(model),
        "input": {"path": "prompts.parquet"},
        "output": {"path": "out"},
        "sampling": dict(SAMPLING),
        "engine": dict(ENGINE),
    }


def write_table(tmp: Path, table: pa.Table | None = None, name: str = "prompts.parquet") -> Path:
    if table is None:
        table = pa.table({"id": list(range(len(PROMPTS))), "prompt": PROMPTS})
    path = tmp / name
    pq.write_table(table, path)
    return path


def set_key(job: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    *parents, last = dotted.split(".")
    node = job
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return job


# --------------------------------------------------------------------------- job-level cases
#
# A case prepares tmp (the job folder) and returns (job file, extra CLI args, needles). The
# needles are what the one line must name. Every case goes through run and through validate.

Setup = Callable[[Path, Path], tuple[Path, list[str], list[str]]]
CASES: dict[str, Setup] = {}
BOTH = ("run", "validate")
PERMISSION_CASES = {"model-folder-unreadable", "weights-unreadable", "output-not-writable"}


def case(name: str) -> Callable[[Setup], Setup]:
    def register(fn: Setup) -> Setup:
        CASES[name] = fn
        return fn

    return register


def with_job(tmp: Path, model_dir: Path, /, **keys: Any) -> Path:
    """The base job with dotted keys replaced (``sampling__n=0`` sets sampling.n)."""
    write_table(tmp)
    job = base_job(model_dir)
    for key, value in keys.items():
        set_key(job, key.replace("__", "."), value)
    return write_job_file(tmp, job)


# -- the job file


@case("yaml-syntax")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    write_table(tmp)
    text = (
        f"model: {model}\n"
        "input:\n"
        "  path: prompts.parquet\n"
        "output:\n"
        "  path: out\n"
        "sampling:\n"
        "  temperature: 0\n"
        "   max_tokens: 4\n"  # line 8: one space too many
    )
    return write_job_file(tmp, text), [], ["job.yaml", "invalid YAML", "line 8"]


@case("yaml-tab-indent")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    write_table(tmp)
    text = f"model: {model}\ninput:\n\tpath: prompts.parquet\noutput:\n  path: out\n"
    return write_job_file(tmp, text), [], ["job.yaml", "invalid YAML", "line 3"]


@case("yaml-duplicate-key")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    write_table(tmp)
    text = yaml.safe_dump(base_job(model)) + "sampling:\n  n: 2\n"
    return write_job_file(tmp, text), [], ["job.yaml", "duplicate key 'sampling'"]


@case("not-a-mapping")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    return write_job_file(tmp, "- model\n- input\n"), [], ["job.yaml", "mapping"]


@case("job-file-missing")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    return tmp / "nope.yaml", [], [str(tmp / "nope.yaml"), "not found"]


@case("missing-required-key")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    write_table(tmp)
    job = base_job(model)
    del job["output"]
    return write_job_file(tmp, job), [], ["missing required key 'output'"]


@case("unknown-top-key")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    write_table(tmp)
    job = base_job(model)
    job["modle"] = job.pop("model")
    return write_job_file(tmp, job), [], ["unknown key 'modle'", "did you mean 'model'?"]


@case("unknown-sampling-key")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    path = with_job(tmp, model, sampling__temprature=0.5)
    return path, [], ["unknown key 'sampling.temprature'", "did you mean 'temperature'?"]


@case("unknown-engine-key")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    path = with_job(tmp, model, engine__blocksize=32)
    return path, [], ["unknown key 'engine.blocksize'", "did you mean 'block_size'?"]


@case("unknown-input-key-no-close-match")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    path = with_job(tmp, model, input__zzz=1)
    return path, [], ["unknown key 'input.zzz'", "prompt_column"]


@case("section-not-a-mapping")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    write_table(tmp)
    job = base_job(model)
    job["sampling"] = [1, 2]
    return write_job_file(tmp, job), [], ["sampling", "mapping"]


@case("both-prompt-and-messages")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    path = with_job(tmp, model, input__prompt_column="prompt", input__messages_column="chat")
    return path, [], ["input", "prompt_column", "messages_column"]


# -- --set


@case("set-unknown-key")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    args = ["--set", "sampling.temprature=0"]
    return with_job(tmp, model), args, ["sampling.temprature", "did you mean 'temperature'?"]


@case("set-unknown-section")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    args = ["--set", "sampler.n=2"]
    return with_job(tmp, model), args, ["unknown key 'sampler'", "did you mean 'sampling'?"]


@case("set-bad-value")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    args = ["--set", "sampling.top_p=1.5"]
    return with_job(tmp, model), args, ["sampling.top_p", "1.5"]


@case("set-wrong-type")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    args = ["--set", "engine.max_num_seqs=lots"]
    return with_job(tmp, model), args, ["engine.max_num_seqs", "'lots'"]


@case("set-without-equals")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    args = ["--set", "sampling.n"]
    return with_job(tmp, model), args, ["sampling.n", "KEY=VALUE"]


@case("set-invalid-yaml")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    args = ["--set", "sampling.stop=[a, b"]
    return with_job(tmp, model), args, ["sampling.stop", "invalid YAML"]


@case("set-into-a-leaf")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    args = ["--set", "sampling.n.x=1"]
    return with_job(tmp, model), args, ["sampling.n.x"]


# -- the model folder


@case("model-folder-missing")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    return with_job(tmp, model, model="no-such-model"), [], [str(tmp / "no-such-model")]


@case("model-path-is-a-file")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    (tmp / "weights.bin").write_bytes(b"x")
    return with_job(tmp, model, model="weights.bin"), [], [str(tmp / "weights.bin")]


@case("model-folder-empty")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    (tmp / "model").mkdir()
    return with_job(tmp, model, model="model"), [], ["config.json", str(tmp / "model")]


@case("config-json-corrupt")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    m = copy_model(model, tmp)
    (m / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    return with_job(tmp, m), [], ["config.json", str(m / "config.json")]


@case("config-json-bad-value")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    m = copy_model(model, tmp)
    cfg = json.loads((m / "config.json").read_text())
    cfg["num_hidden_layers"] = "two"
    (m / "config.json").write_text(json.dumps(cfg))
    return with_job(tmp, m), [], ["num_hidden_layers", str(m / "config.json")]


@case("unsupported-architecture")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    m = copy_model(model, tmp)
    cfg = json.loads((m / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (m / "config.json").write_text(json.dumps(cfg))
    needles = [
        "GPT2LMHeadModel",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen2MoeForCausalLM",
        "MixtralForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
        "GptOssForCausalLM",
    ]
    return with_job(tmp, m), [], needles


@case("weights-missing")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    m = copy_model(model, tmp)
    (m / "model.safetensors").unlink()
    return with_job(tmp, m), [], ["no weights", "safetensors", str(m)]


@case("weights-truncated")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    m = copy_model(model, tmp)
    data = (m / "model.safetensors").read_bytes()
    (m / "model.safetensors").write_bytes(data[: len(data) * 2 // 3])  # a half-finished copy
    return with_job(tmp, m), [], ["truncated", str(m / "model.safetensors")]


@case("weights-truncated-in-header")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    m = copy_model(model, tmp)
    data = (m / "model.safetensors").read_bytes()
    (m / "model.safetensors").write_bytes(data[:100])
    return with_job(tmp, m), [], ["truncated", str(m / "model.safetensors")]


@case("weights-garbage")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    m = copy_model(model, tmp)
    (m / "model.safetensors").write_bytes(b"<html>404 Not Found</html>" * 40)
    return with_job(tmp, m), [], ["corrupt", str(m / "model.safetensors")]


@case("weights-dangling-symlink")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    # A copied Hugging Face cache snapshot whose blobs were not copied.
    m = copy_model(model, tmp)
    (m / "model.safetensors").unlink()
    (m / "model.safetensors").symlink_to(tmp / "blobs" / "0123abcd")
    return with_job(tmp, m), [], [str(m / "model.safetensors")]


@case("weights-tensor-missing")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    from safetensors.torch import load_file, save_file

    m = copy_model(model, tmp)
    tensors = load_file(m / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, m / "model.safetensors", metadata={"format": "pt"})
    return with_job(tmp, m), [], ["model.layers.1.mlp.up_proj.weight", str(m)]


@case("weights-wrong-shape")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    # config.json of one model, weights of another
    m = copy_model(model, tmp)
    cfg = json.loads((m / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (m / "config.json").write_text(json.dumps(cfg))
    return with_job(tmp, m), [], ["shape", "mlp", str(m)]


@case("weights-shard-missing")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    from safetensors import safe_open

    m = copy_model(model, tmp)
    with safe_open(str(m / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    weight_map = {n: "model.safetensors" for n in names}
    weight_map[names[-1]] = "model-00002-of-00002.safetensors"
    (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return with_job(tmp, m), [], ["model-00002-of-00002.safetensors"]


@case("tokenizer-missing")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    m = copy_model(model, tmp)
    (m / "tokenizer.json").unlink()
    return with_job(tmp, m), [], ["tokenizer", str(m)]


@case("tokenizer-corrupt")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    m = copy_model(model, tmp)
    (m / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    return with_job(tmp, m), [], ["tokenizer", str(m)]


@case("tokenizer-unloadable")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    # Complete JSON that the tokenizers library cannot build a tokenizer from.
    m = copy_model(model, tmp)
    (m / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    return with_job(tmp, m), [], ["cannot load the tokenizer", str(m)]


@case("chat-template-missing")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    # Every row would be an error row: a problem of the job, not of its rows.
    m = copy_model(model, tmp)
    (m / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((m / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (m / "tokenizer_config.json").write_text(json.dumps(config))
    path = with_job(tmp, m, input__messages_column="chat")
    write_table(tmp, pa.table({"id": [0], "chat": [[{"role": "user", "content": "hi"}]]}))
    return path, [], [str(m), "chat_template", "input.messages_column"]


@case("stop-token-outside-vocabulary")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    path = with_job(tmp, model, sampling__stop_token_ids=[2, vocab])
    return path, [], ["sampling.stop_token_ids", str(vocab), str(model)]


@case("model-folder-unreadable")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    m = copy_model(model, tmp)
    m.chmod(0)
    return with_job(tmp, m), [], [str(m), "cannot read"]


@case("weights-unreadable")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    m = copy_model(model, tmp)
    (m / "model.safetensors").chmod(0)
    return with_job(tmp, m), [], [str(m / "model.safetensors"), "cannot read"]


# -- the input


@case("input-missing")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    path = with_job(tmp, model, input__path="data/prompts.parquet")
    return path, [], [str(tmp / "data" / "prompts.parquet"), "does not exist"]


@case("input-glob-matches-nothing")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    path = with_job(tmp, model, input__path="shards/*.parquet")
    return path, [], [str(tmp / "shards" / "*.parquet"), "matches no files"]


@case("input-folder-empty")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    (tmp / "shards").mkdir()
    path = with_job(tmp, model, input__path="shards")
    return path, [], [str(tmp / "shards"), "no *.parquet"]


@case("input-not-parquet")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    path = with_job(tmp, model)
    (tmp / "prompts.parquet").write_text("id,prompt\n0,hello\n")
    return path, [], [str(tmp / "prompts.parquet"), "not a Parquet file"]


@case("input-truncated-parquet")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    path = with_job(tmp, model)
    data = (tmp / "prompts.parquet").read_bytes()
    (tmp / "prompts.parquet").write_bytes(data[: len(data) // 2])
    return path, [], [str(tmp / "prompts.parquet")]


@case("input-missing-prompt-column")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    path = with_job(tmp, model, input__prompt_column="question")
    return path, [], [str(tmp / "prompts.parquet"), "'question'", "input.prompt_column"]


@case("input-missing-id-column")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    path = with_job(tmp, model, input__id_column="uid")
    return path, [], [str(tmp / "prompts.parquet"), "'uid'", "input.id_column"]


@case("input-missing-messages-column")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    path = with_job(tmp, model, input__messages_column="chat")
    return path, [], ["'chat'", "input.messages_column"]


@case("input-missing-keep-column")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    path = with_job(tmp, model, input__keep_columns=["topic"])
    return path, [], ["'topic'", "input.keep_columns"]


@case("input-prompt-column-not-text")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    path = with_job(tmp, model)
    write_table(tmp, pa.table({"id": [0, 1], "prompt": [1, 2]}))
    return path, [], ["'prompt'", "int64", "string"]


@case("input-messages-without-role")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    path = with_job(tmp, model, input__messages_column="chat")
    write_table(tmp, pa.table({"id": [0], "chat": [[{"speaker": "user", "content": "hi"}]]}))
    return path, [], ["'chat'", "input.messages_column", "role"]


@case("input-messages-content-not-text")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    # Parquet types a whole column: content that is not text is a problem of the column.
    path = with_job(tmp, model, input__messages_column="chat")
    write_table(tmp, pa.table({"id": [0], "chat": [[{"role": "user", "content": 7}]]}))
    return path, [], ["'chat'", "input.messages_column", "int64"]


@case("input-messages-not-a-list")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    path = with_job(tmp, model, input__messages_column="chat")
    write_table(tmp, pa.table({"id": [0], "chat": ['[{"role": "user", "content": "hi"}]']}))
    return path, [], ["'chat'", "input.messages_column", "string"]


@case("input-duplicate-ids")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    path = with_job(tmp, model)
    ids = [0, 1, 2, 3, 4, 5, 6, 7] + [3, 7, 1, 6, 5, 0, 2]
    write_table(tmp, pa.table({"id": ids, "prompt": ["p"] * len(ids)}))
    return path, [], ["id column 'id'", "duplicate ids: 0, 1, 2, 3, 5", "and 2 more"]


@case("input-duplicate-ids-across-files")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    path = with_job(tmp, model, input__path="shards")
    (tmp / "shards").mkdir()
    write_table(tmp / "shards", pa.table({"id": ["a", "b"], "prompt": ["x", "y"]}), "0.parquet")
    write_table(tmp / "shards", pa.table({"id": ["c", "b"], "prompt": ["x", "y"]}), "1.parquet")
    return path, [], ["duplicate ids: 'b'"]


@case("input-null-ids")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    path = with_job(tmp, model)
    write_table(tmp, pa.table({"id": ["a", None, "c"], "prompt": ["x", "y", "z"]}))
    return path, [], [str(tmp / "prompts.parquet"), "'id'", "null"]


@case("input-id-invalid-utf8")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    path = with_job(tmp, model)
    write_table(tmp, pa.table({"id": raw_strings([b"a", b"b\xff"]), "prompt": ["x", "y"]}))
    return path, [], [str(tmp / "prompts.parquet"), "'id'", "UTF-8"]


# -- engine settings that cannot work here


@case("kv-cache-too-small")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    path = with_job(tmp, model, engine__kv_cache_blocks=None, engine__kv_cache_memory=1000)
    return path, [], ["engine.kv_cache_memory", "no room for one KV block"]


@case("device-without-cuda")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    return with_job(tmp, model, engine__device="cuda:0"), [], ["engine.device", "CUDA"]


# -- the output folder


@case("output-is-a-file")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    (tmp / "results.parquet").write_bytes(b"x")
    path = with_job(tmp, model, output__path="results.parquet")
    return path, [], [str(tmp / "results.parquet"), "is a file"]


@case("output-under-a-file")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    (tmp / "results").write_bytes(b"x")
    path = with_job(tmp, model, output__path="results/run-1")
    return path, [], [str(tmp / "results" / "run-1")]


@case("output-not-writable")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    (tmp / "out").mkdir()
    (tmp / "out").chmod(0o555)
    return with_job(tmp, model), [], [str(tmp / "out"), "not writable"]


@case("output-foreign-folder")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    (tmp / "out").mkdir()
    (tmp / "out" / "notes.txt").write_text("mine")
    return with_job(tmp, model), [], [str(tmp / "out"), "not a batchgen output folder"]


@case("output-of-another-job")
def _(tmp: Path, model: Path) -> tuple[Path, list[str], list[str]]:
    path = with_job(tmp, model)
    assert invoke("run", path, "--quiet").exit_code == 0
    path = write_job_file(tmp, set_key(base_job(model), "sampling.max_tokens", 3))
    return path, [], [str(tmp / "out"), "different job", "sampling differs", "--fresh"]


# -- every problem of a value names its key

BAD_VALUES: list[tuple[str, Any]] = [
    ("sampling.n", 0),
    ("sampling.n", "two"),
    ("sampling.n", 1.5),
    ("sampling.max_tokens", 0),
    ("sampling.temperature", -0.1),
    ("sampling.temperature", "hot"),
    ("sampling.temperature", float("nan")),
    ("sampling.top_p", 0),
    ("sampling.top_p", 1.01),
    ("sampling.top_k", -1),
    ("sampling.min_p", -0.5),
    ("sampling.min_p", 1.5),
    ("sampling.repetition_penalty", 0),
    ("sampling.presence_penalty", 2.5),
    ("sampling.frequency_penalty", -3),
    ("sampling.seed", -1),
    ("sampling.stop", [""]),
    ("sampling.stop", 7),
    ("sampling.stop_token_ids", [-1]),
    ("sampling.ignore_eos", "maybe"),
    ("sampling.logprobs", -1),
    ("sampling.logprobs", "yes"),
    ("sampling.prompt_logprobs", -1),
    ("output.reasoning", "maybe"),
    ("task", "classify"),
    ("engine.block_size", 12),
    ("engine.block_size", 0),
    ("engine.device", "tpu"),
    ("engine.dtype", "float8"),
    ("engine.kv_cache_memory", "lots"),
    ("engine.kv_cache_memory", "4 GX"),
    ("engine.kv_cache_blocks", 0),
    ("engine.max_num_seqs", 0),
    ("engine.max_num_batched_tokens", -8),
    ("engine.max_model_len", 0),
    ("engine.attention_backend", "flash"),
    ("engine.prefix_caching", "on"),
    ("input.window_rows", 0),
    ("input.id_column", 3),
    ("input.keep_columns", ["a", "a"]),
    ("output.commit_rows", 0),
    ("output.commit_seconds", 0),
    ("model", 5),
    ("model", ""),
]


def _value_id(key_value: tuple[str, Any]) -> str:
    key, value = key_value
    return f"{key}={value!r}"


@pytest.mark.parametrize("command", BOTH)
@pytest.mark.parametrize("key_value", BAD_VALUES, ids=_value_id)
def test_bad_value_names_its_key(
    key_value: tuple[str, Any], command: str, model: Path, tmp_path: Path
) -> None:
    key, value = key_value
    write_table(tmp_path)
    job = write_job_file(tmp_path, set_key(base_job(model), key, value))
    # A check across a section's keys names the section and the key.
    needle = {"input.keep_columns": "input: keep_columns"}.get(key, key)
    one_line(invoke(command, job), 2, "error: ", str(job), needle)
    assert not (tmp_path / "out").exists()  # nothing written for a job that never started


@pytest.mark.parametrize(
    "key_value",
    [
        ("sampling.n", "0"),
        ("sampling.top_k", "-2"),
        ("engine.block_size", "24"),
        ("sampling.temperature", "-1"),
        ("engine.device", "gpu"),
    ],
    ids=_value_id,
)
def test_bad_set_value_names_its_key(
    key_value: tuple[str, str], model: Path, tmp_path: Path
) -> None:
    key, value = key_value
    job = with_job(tmp_path, model)
    for command in BOTH:
        one_line(invoke(command, job, "--set", f"{key}={value}"), 2, "error: ", key)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", BOTH)
@pytest.mark.parametrize("name", list(CASES))
def test_job_level_problem_is_one_line(
    name: str, command: str, model: Path, tmp_path: Path
) -> None:
    if name in PERMISSION_CASES and not PERMISSIONS_APPLY:
        pytest.skip("file permissions do not stop this user (root)")
    job, args, needles = CASES[name](tmp_path, model)
    before = sorted(p.name for p in tmp_path.iterdir())
    out_before = _tree(tmp_path / "out")
    line = one_line(invoke(command, job, *args), 2, "error: ", *needles)
    assert len(line) < 600, line
    # A refused job leaves no trace: no output folder or log is made, and an existing output
    # folder (the output-* cases) stays as it was, byte for byte.
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert _tree(tmp_path / "out") == out_before


def _tree(path: Path) -> dict[str, bytes] | None:
    if not path.is_dir():
        return None
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def test_fixed_model_resumes_into_the_same_folder(model: Path, tmp_path: Path) -> None:
    """A half-copied model is refused before the output folder is touched, so once the copy is
    complete the same command runs (not "holds a different job")."""
    m = copy_model(model, tmp_path)
    good = (m / "model.safetensors").read_bytes()
    (m / "model.safetensors").write_bytes(good[: len(good) // 2])
    job = with_job(tmp_path, m)
    one_line(invoke("run", job, "--quiet"), 2, "truncated")
    (m / "model.safetensors").write_bytes(good)
    result = invoke("run", job, "--quiet")
    no_traceback(result)
    assert result.exit_code == 0, result.output
    assert len(read_results(tmp_path / "out")) == len(PROMPTS)


def test_corrupt_row_group_found_mid_run(model: Path, tmp_path: Path) -> None:
    """A data page that cannot be read is found only when its rows are read (validate reads
    metadata and ids): the job stops with one line naming the file, and what was committed
    before stays readable, each row once."""
    prompts = make_prompts(40, seed=0, min_words=2, max_words=6)
    job = base_job(model)
    job["input"]["window_rows"] = 10
    job["engine"]["max_num_seqs"] = 2
    job["output"]["commit_rows"] = 1
    job = write_job_file(tmp_path, job)
    path = tmp_path / "prompts.parquet"
    pq.write_table(
        pa.table({"id": list(range(40)), "prompt": prompts}),
        path,
        compression="none",
        use_dictionary=False,
        row_group_size=10,
    )
    page = pq.read_metadata(path).row_group(3).column(1).data_page_offset
    data = bytearray(path.read_bytes())
    data[page : page + 4] = b"\xff\xff\xff\x7f"  # the page header of the last prompts
    path.write_bytes(bytes(data))
    assert invoke("validate", job).exit_code == 0
    one_line(invoke("run", job, "--quiet"), 2, "error: ", str(path))
    rows = read_results(tmp_path / "out")
    assert rows, "rows finished before the bad row group were committed"
    assert len({r["id"] for r in rows}) == len(rows) and all(r["id"] < 30 for r in rows)


# --------------------------------------------------------------------------- empty input


def test_empty_input_completes_cleanly(model: Path, tmp_path: Path) -> None:
    job = with_job(tmp_path, model)
    write_table(
        tmp_path, pa.table({"id": pa.array([], pa.int64()), "prompt": pa.array([], pa.string())})
    )
    result = invoke("validate", job)
    no_traceback(result)
    assert result.exit_code == 0 and "0 rows" in result.stdout
    result = invoke("run", job, "--quiet")
    no_traceback(result)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / ".batchgen" / "report.json").read_text())
    assert report["finished"] is True
    assert (report["rows"], report["samples"], report["errors"]) == (0, 0, 0)
    assert read_results(tmp_path / "out") == []
    # Running it again is a no-op that also succeeds.
    assert invoke("run", job, "--quiet").exit_code == 0


# --------------------------------------------------------------------------- row-level problems


def raw_strings(values: list[bytes | None]) -> pa.Array:
    """A string array holding these bytes as they are (invalid UTF-8 included), the way a
    careless writer can put them into a Parquet file."""
    offsets = [0]
    for v in values:
        offsets.append(offsets[-1] + len(v or b""))
    data = b"".join(v or b"" for v in values)
    validity = pa.array([v is not None for v in values]).buffers()[1]
    return pa.Array.from_buffers(
        pa.string(),
        len(values),
        [validity, pa.py_buffer(pa.array(offsets, pa.int32()).buffers()[1]), pa.py_buffer(data)],
    )


def prompt_of_length(tokenizer: Any, n: int) -> str:
    """A prompt of exactly n tokens (BOS included)."""
    # The seeds are searched for a property of the data (a word boundary at exactly n tokens),
    # not to avoid near-ties: whichever prompt is found, the tests must pass.
    for seed in range(200):
        words = make_words(n * 2, seed=seed)
        for k in range(1, len(words)):
            length = len(tokenizer(" ".join(words[:k]))["input_ids"])
            if length == n:
                return " ".join(words[:k])
            if length > n:
                break
    raise AssertionError(f"no prompt of {n} tokens")


MAX_LEN = 40


class _PickyTokenizer:
    """Wraps the real tokenizer; cannot encode text holding a NUL (as a real tokenizer may fail
    on some input)."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def __call__(self, text: Any, **kwargs: Any) -> Any:
        texts = [text] if isinstance(text, str) else text
        if any("\x00" in t for t in texts):
            raise ValueError("byte 0x00 is not in the vocabulary")
        return self._tok(text, **kwargs)


@pytest.fixture
def picky_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    import batchgen.runner

    real = batchgen.runner.load_tokenizer
    monkeypatch.setattr(batchgen.runner, "load_tokenizer", lambda m: _PickyTokenizer(real(m)))


def run_ok(job: Path) -> list[dict[str, Any]]:
    result = invoke("run", job, "--quiet")
    no_traceback(result)
    assert result.exit_code == 0, (result.output, result.exception)
    return read_results(job.parent / "out")


def check_rows(
    rows: list[dict[str, Any]],
    good: Mapping[Any, str],
    bad: dict[Any, str],
    reference: list[dict[str, Any]],
    *,
    model: Path,
    sampling: dict[str, Any],
    keep: str | None = None,
) -> None:
    """Every id has n rows; bad ids are error rows naming their reason; good rows (``good``: id
    -> prompt text as the model sees it) equal the reference job's rows, up to near-tie flips
    (the reference ran without the bad rows, so in other batches)."""
    n = sampling["n"]
    good_ids = list(good)
    counts = Counter((r["id"], r["sample_index"]) for r in rows)
    assert set(counts) == {(i, k) for i in [*good_ids, *bad] for k in range(n)}
    assert set(counts.values()) == {1}
    by_id: dict[Any, list[dict[str, Any]]] = {}
    for r in rows:
        by_id.setdefault(r["id"], []).append(r)
    for row_id, reason in bad.items():
        for r in by_id[row_id]:
            assert r["finish_reason"] == "error", r
            assert reason in r["error"], (reason, r["error"])
            assert "\n" not in r["error"] and len(r["error"]) < 300
            assert r["token_ids"] == [] and r["text"] == ""
            assert r["num_output_tokens"] == 0 and r["num_cached_tokens"] == 0
            if keep is not None:
                assert r[keep] == f"tag-{row_id}"
    good_rows = [r for r in rows if r["id"] in good]
    compare_samples(good_rows, reference, model=model, prompts=good, sampling=sampling)
    ref = {(r["id"], r["sample_index"]): r for r in reference}
    for r in good_rows:
        assert r["finish_reason"] in ("stop", "length") and r["error"] is None
        expected = ref[(r["id"], r["sample_index"])]
        assert r["num_prompt_tokens"] == expected["num_prompt_tokens"], r["id"]
        if r["token_ids"] == expected["token_ids"]:  # not a near-tie flip: all the same
            for column in ("text", "finish_reason", "num_output_tokens"):
                assert r[column] == expected[column], (r["id"], column)


def chat_prompt(model: Path, chat: list[dict[str, Any]]) -> str:
    """The text that, tokenized with special tokens as compare_samples does, gives the ids
    batchgen runs for ``chat`` (the template writes the BOS itself)."""
    from batchgen.model.loader import load_tokenizer

    tok = load_tokenizer(model)
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith(tok.bos_token), rendered
    text = rendered[len(tok.bos_token) :]
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    assert tok(text, add_special_tokens=True)["input_ids"] == ids
    return text


def check_report(out: Path, rows: int, error_rows: int, n: int) -> None:
    report = json.loads((out / ".batchgen" / "report.json").read_text())
    assert report["finished"] is True
    assert report["rows"] == rows and report["samples"] == rows * n
    assert report["errors"] == error_rows * n  # error output rows, as the manifest counts them
    manifest = json.loads((out / ".batchgen" / "manifest.json").read_text())
    assert manifest["totals"]["errors"] == report["errors"]


def test_bad_prompts_become_error_rows(
    model: Path, tokenizer: Any, tmp_path: Path, picky_tokenizer: None
) -> None:
    n = 2
    good = {
        0: PROMPTS[0],
        2: PROMPTS[1],
        5: prompt_of_length(tokenizer, MAX_LEN - 1),  # room for exactly one output token
        7: PROMPTS[2],
        9: "   ",  # only spaces: still a prompt
        11: PROMPTS[3],
    }
    bad: dict[int, tuple[bytes | None, str]] = {
        1: (None, "prompt is null"),
        3: (b"", "prompt is empty"),
        4: (" ".join(make_words(20000, seed=1)).encode(), "max_model_len"),  # ~50k tokens
        6: (prompt_of_length(tokenizer, MAX_LEN).encode(), "no room"),
        8: (b"abc \xff\xfe def", "UTF-8"),
        10: (b"before \x00 after", "tokenizer cannot encode"),
    }
    sampling = {"temperature": 0, "max_tokens": 5, "n": n}
    engine = {**ENGINE, "max_model_len": MAX_LEN}
    input_extra = {"keep_columns": ["tag"]}

    def job_in(folder: Path, ids: list[int], values: list[bytes | None]) -> Path:
        folder.mkdir()
        table = pa.table(
            {"id": ids, "prompt": raw_strings(values), "tag": [f"tag-{i}" for i in ids]}
        )
        write_table(folder, table)
        job = base_job(model)
        job["sampling"] = sampling
        job["engine"] = engine
        job["input"].update(input_extra)
        job["output"]["commit_rows"] = 3
        return write_job_file(folder, job)

    reference = run_ok(job_in(tmp_path / "ref", list(good), [p.encode() for p in good.values()]))
    # Interleave bad and good rows, and let a window hold both.
    ids = sorted([*good, *bad])
    values = [good[i].encode() if i in good else bad[i][0] for i in ids]
    job = job_in(tmp_path / "mixed", ids, values)
    assert invoke("validate", job).exit_code == 0  # row problems are not job problems
    rows = run_ok(job)
    reasons = {i: reason for i, (_, reason) in bad.items()}
    check_rows(rows, good, reasons, reference, model=model, sampling=sampling, keep="tag")
    over = [r for r in rows if r["id"] == 4][0]["error"]
    assert re.search(r"prompt has \d{5,} tokens", over) and f"max_model_len is {MAX_LEN}" in over
    one_token = [r for r in rows if r["id"] == 5]
    assert all(r["num_output_tokens"] == 1 and r["finish_reason"] == "length" for r in one_token)
    check_report(tmp_path / "mixed" / "out", len(ids), len(bad), n)
    # A second run finds the job done, error rows included: nothing is written twice.
    assert run_ok(job) == rows


def test_bad_messages_become_error_rows(model: Path, tmp_path: Path) -> None:
    m = copy_model(model, tmp_path)
    # A template that, like many real ones, rejects roles it does not know.
    (m / "chat_template.jinja").write_text(
        "{% for message in messages %}{% if message['role'] not in "
        "['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + message['role']) }}"
        "{% endif %}{% endfor %}" + CHAT_TEMPLATE
    )
    n = 3

    def msg(role: str | None, content: str | None) -> dict[str, Any]:
        return {"role": role, "content": content}

    good = {
        "a": [msg("system", "be brief"), msg("user", PROMPTS[0])],
        "c": [msg("user", PROMPTS[1])],
        "f": [msg("user", PROMPTS[2]), msg("assistant", "ok"), msg("user", "more")],
    }
    bad: dict[str, tuple[list[Any] | None, str]] = {
        "b": (None, "chat is null"),
        "d": ([], "chat is empty"),
        "e": ([None], "chat[0] is null"),
        "g": ([msg("user", "hi"), msg(None, "there")], "chat[1].role is null"),
        "h": ([msg("user", None)], "chat[0].content is null"),
        "i": ([msg("robot", "beep")], "unknown role robot"),
        "j": ([msg("user", " ".join(make_words(300, seed=2)))], "max_model_len"),
    }
    chat_type = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    sampling = {"temperature": 0, "max_tokens": 4, "n": n}

    def job_in(folder: Path, chats: dict[str, Any]) -> Path:
        folder.mkdir()
        table = pa.table({"qid": list(chats), "chat": pa.array(list(chats.values()), chat_type)})
        write_table(folder, table)
        job = base_job(m)
        job["sampling"] = sampling
        job["engine"] = {**ENGINE, "max_model_len": 64}
        job["input"].update({"messages_column": "chat", "id_column": "qid"})
        return write_job_file(folder, job)

    reference = run_ok(job_in(tmp_path / "ref", good))
    chats = {k: good[k] if k in good else bad[k][0] for k in sorted([*good, *bad])}
    job = job_in(tmp_path / "mixed", chats)
    assert invoke("validate", job).exit_code == 0
    rows = run_ok(job)
    reasons = {k: reason for k, (_, reason) in bad.items()}
    texts = {k: chat_prompt(m, chat) for k, chat in good.items()}
    check_rows(rows, texts, reasons, reference, model=m, sampling=sampling)
    check_report(tmp_path / "mixed" / "out", len(chats), len(bad), n)


def test_only_bad_rows_still_completes(model: Path, tmp_path: Path) -> None:
    job = with_job(tmp_path, model)
    write_table(tmp_path, pa.table({"id": [3, 1], "prompt": pa.array([None, ""], pa.string())}))
    rows = run_ok(job)
    assert [(r["id"], r["finish_reason"]) for r in rows] == [(1, "error"), (3, "error")]
    check_report(tmp_path / "out", 2, 2, 1)


def test_prompt_longer_than_the_kv_cache(model: Path, tokenizer: Any, tmp_path: Path) -> None:
    """A KV cache smaller than the model's context caps max_model_len (one sequence must fit);
    validate says so, and the rows it costs say which setting to raise."""
    job = base_job(model)
    job["engine"] = {"block_size": 4, "kv_cache_blocks": 4}  # 16 tokens
    job = write_job_file(tmp_path, job)
    long = prompt_of_length(tokenizer, 20)
    write_table(tmp_path, pa.table({"id": [0, 1], "prompt": ["short one", long]}))
    result = invoke("validate", job)
    assert result.exit_code == 0 and "max_model_len: 16 (all the KV cache holds" in result.stdout
    rows = run_ok(job)
    assert rows[0]["finish_reason"] in ("stop", "length")
    assert rows[1]["finish_reason"] == "error"
    assert "prompt has 20 tokens; max_model_len is 16" in rows[1]["error"]
    assert "raise engine.kv_cache_blocks" in rows[1]["error"]


# --------------------------------------------------------------------------- internal errors


def test_internal_error_keeps_committed_rows_and_resumes(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchgen.engine.engine import Engine

    prompts = make_prompts(12, seed=0, min_words=2, max_words=12)
    n = 2
    sampling = {"temperature": 0.8, "seed": 0, "max_tokens": 4, "n": n}

    def job_in(folder: Path) -> Path:
        folder.mkdir()
        write_table(folder, pa.table({"id": list(range(len(prompts))), "prompt": prompts}))
        job = base_job(model)
        job["sampling"] = sampling
        job["engine"] = {**ENGINE, "max_num_seqs": 4}
        job["output"].update(commit_rows=2 * n, commit_seconds=3600)  # every 2 input rows
        return write_job_file(folder, job)

    reference = run_ok(job_in(tmp_path / "ref"))

    real_step = Engine.step
    calls = {"n": 0}

    def failing_step(self: Engine) -> Any:
        calls["n"] += 1
        if calls["n"] == 12:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_step(self)

    monkeypatch.setattr(Engine, "step", failing_step)
    job = job_in(tmp_path / "job")
    out = tmp_path / "job" / "out"
    result = invoke("run", job, "--quiet")
    line = one_line(result, 1, "internal error", "RuntimeError", "illegal memory access")
    match = re.search(r"traceback written to (\S+)\)$", line)
    assert match, line
    log = Path(match.group(1))
    assert log.parent == out / ".batchgen" / "logs" and log.name.startswith("error-")
    text = log.read_text()
    assert "Traceback" in text and "failing_step" in text and "RuntimeError" in text
    # What was committed is readable (the log is invisible to Parquet readers) and partial.
    partial = read_results(out)
    assert 0 < len(partial) < len(reference)
    assert Counter(Counter(r["id"] for r in partial).values()) == {n: len(partial) // n}
    # Up to the failure this run computed exactly what the reference did (same job, same
    # settings, same batches): bit-exact.
    for r in partial:
        assert r["token_ids"] == reference[r["id"] * n + r["sample_index"]]["token_ids"]

    monkeypatch.setattr(Engine, "step", real_step)
    del result  # the failed run's objects (and its folder lock) go with it
    import gc

    gc.collect()
    rows = run_ok(job)
    assert Counter((r["id"], r["sample_index"]) for r in rows) == Counter(
        (i, k) for i in range(len(prompts)) for k in range(n)
    )
    # The resumed rows ran in other batches than the reference's: equal up to near-tie flips.
    by_id = dict(enumerate(prompts))
    compare_samples(rows, reference, model=model, prompts=by_id, sampling=sampling)
    # What was committed before the failure is left as it was.
    done = {(r["id"], r["sample_index"]): r["token_ids"] for r in partial}
    assert [r["token_ids"] for r in rows if (r["id"], r["sample_index"]) in done] == list(
        done.values()
    )
    report = json.loads((out / ".batchgen" / "report.json").read_text())
    assert report["finished"] is True and report["rows_already_done"] == len(partial) // n
