"""The job file: defaults, overrides, path resolution, every validation error, fingerprint."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from batchgen.errors import JobError
from batchgen.fingerprint import describe_fingerprint_mismatch, fingerprint
from batchgen.job import Job, parse_memory
from batchgen.jobfile import load_job
from tests.jobkit import write_job_file

MINIMAL = "model: models/tiny\ninput:\n  path: data/p.parquet\noutput:\n  path: out/run\n"


def job_from(tmp_path: Path, extra: dict | None = None, overrides=()) -> Job:
    raw = yaml.safe_load(MINIMAL)
    for section, values in (extra or {}).items():
        if isinstance(values, dict) and isinstance(raw.get(section), dict):
            raw[section] = {**raw[section], **values}
        else:
            raw[section] = values
    return load_job(write_job_file(tmp_path, yaml.safe_dump(raw)), overrides)


def error_of(tmp_path: Path, extra: dict | None = None, overrides=()) -> str:
    with pytest.raises(JobError) as info:
        job_from(tmp_path, extra, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------- defaults, paths


# The defaults docs/job-file.md lists, written out here (not taken from the code), for every
# key batchgen implements: a key added without its default here fails the tests below.
DOCUMENTED_INPUT = {
    "prompt_column": "prompt",
    "messages_column": None,
    "id_column": "id",
    "keep_columns": (),
    "schema_column": None,
    "format": "auto",
    "sampling_columns": {},
    "window_rows": 10000,
}
DOCUMENTED_OUTPUT = {"commit_rows": 1000, "commit_seconds": 5.0}
DOCUMENTED_SAMPLING = {
    "n": 1,
    "max_tokens": 256,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "stop": (),
    "stop_token_ids": (),
    "ignore_eos": False,
    "seed": 0,
    "logprobs": False,
    "structured": None,
}
DOCUMENTED_ENGINE = {
    "device": "auto",
    "dtype": "auto",
    "kv_cache_dtype": "auto",
    "block_size": 16,
    "kv_cache_memory": "auto",
    "kv_cache_blocks": None,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "max_model_len": None,
    "attention_backend": "auto",
    "prefix_caching": True,
    "cuda_graphs": "off",
    "overlap": "auto",  # launch steps ahead of the token readback (CUDA)
}


def assert_spec_defaults(job: Job) -> None:
    assert job.sampling.model_dump() == DOCUMENTED_SAMPLING
    assert job.engine.model_dump() == DOCUMENTED_ENGINE


def test_defaults_follow_spec(tmp_path: Path) -> None:
    job = load_job(write_job_file(tmp_path, MINIMAL))
    assert job.input.model_dump(exclude={"path"}) == DOCUMENTED_INPUT
    assert job.output.model_dump(exclude={"path"}) == DOCUMENTED_OUTPUT
    assert_spec_defaults(job)


def test_relative_paths_resolve_against_job_folder(tmp_path: Path) -> None:
    sub = tmp_path / "jobs"
    (sub / "models" / "tiny").mkdir(parents=True)  # else org/name would be a hub id
    job = load_job(write_job_file(sub, MINIMAL))
    assert job.model == sub / "models" / "tiny"
    assert job.hub_id is None
    assert job.input.path == str(sub / "data" / "p.parquet")
    assert job.output.path == sub / "out" / "run"


def test_absolute_paths_kept_and_globs_allowed(tmp_path: Path) -> None:
    text = "model: /abs/model\ninput:\n  path: data/*.parquet\noutput:\n  path: /abs/out\n"
    job = load_job(write_job_file(tmp_path, text))
    assert job.model == Path("/abs/model")
    assert job.output.path == Path("/abs/out")
    assert job.input.path == str(tmp_path / "data" / "*.parquet")


def test_full_spec_example_parses(tmp_path: Path) -> None:
    text = """
model: models/tiny-llama
input:
  path: data/prompts.parquet
  prompt_column: prompt
  messages_column: null
  id_column: id
  keep_columns: []
output:
  path: out/run-1
sampling:
  n: 1
  max_tokens: 256
  temperature: 1.0
  top_p: 1.0
  top_k: 0
  min_p: 0.0
  repetition_penalty: 1.0
  presence_penalty: 0.0
  frequency_penalty: 0.0
  stop: []
  stop_token_ids: []
  ignore_eos: false
  seed: 0
  logprobs: false
engine:
  device: auto
  dtype: auto
  block_size: 16
  kv_cache_memory: auto
  kv_cache_blocks: null
  max_num_seqs: 256
  max_num_batched_tokens: 8192
  max_model_len: null
  attention_backend: auto
  prefix_caching: true
  cuda_graphs: off
"""
    assert_spec_defaults(load_job(write_job_file(tmp_path, text)))


def test_job_is_frozen(tmp_path: Path) -> None:
    job = load_job(write_job_file(tmp_path, MINIMAL))
    with pytest.raises(ValidationError, match="frozen"):
        job.sampling.n = 3  # type: ignore[misc]


def test_messages_column_replaces_prompt_default(tmp_path: Path) -> None:
    job = job_from(tmp_path, {"input": {"messages_column": "messages"}})
    assert job.input.prompt_column is None
    assert job.input.messages_column == "messages"


def test_empty_sections_mean_defaults(tmp_path: Path) -> None:
    assert_spec_defaults(load_job(write_job_file(tmp_path, MINIMAL + "sampling:\nengine:\n")))


def test_single_stop_string_and_exponent_float(tmp_path: Path) -> None:
    job = load_job(
        write_job_file(tmp_path, MINIMAL + "sampling:\n  stop: '###'\n  temperature: 1e-3\n")
    )
    assert job.sampling.stop == ("###",)
    assert job.sampling.temperature == pytest.approx(0.001)


# --------------------------------------------------------------------------- overrides


def test_overrides_apply_and_parse_yaml(tmp_path: Path) -> None:
    job = job_from(
        tmp_path,
        overrides=[
            "engine.block_size=32",
            "sampling.stop=['a', 'b']",
            "sampling.temperature=0",
            "engine.kv_cache_memory=4GiB",
            "input.id_column=null",
            "sampling.n=2",
            "sampling.n=3",  # the last one wins
        ],
    )
    assert job.engine.block_size == 32
    assert job.sampling.stop == ("a", "b")
    assert job.sampling.temperature == 0.0
    assert job.engine.kv_cache_memory == 4 << 30
    assert job.input.id_column is None
    assert job.sampling.n == 3


def test_override_paths_resolve_against_job_folder(tmp_path: Path) -> None:
    job = job_from(tmp_path, overrides=["output.path=elsewhere", "model=m2"])
    assert job.output.path == tmp_path / "elsewhere"
    assert job.model == tmp_path / "m2"


def test_override_into_missing_section(tmp_path: Path) -> None:
    text = "model: m\ninput:\n  path: p.parquet\n"
    job = load_job(write_job_file(tmp_path, text), ["output.path=o"])
    assert job.output.path == tmp_path / "o"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "sampling.temprature=1",
            "unknown key 'sampling.temprature' (did you mean 'temperature'?)",
        ),
        ("engin.block_size=1", "unknown key 'engin' (did you mean 'engine'?)"),
        ("model.x=1", "unknown key 'model.x'"),
        ("engine.block_size", "expected KEY=VALUE"),
        ("=3", "expected KEY=VALUE"),
        ("engine.block_size=[", "invalid YAML value"),
        ("engine.block_size=24", "engine.block_size: must be a power of two"),
    ],
)
def test_bad_overrides(tmp_path: Path, override: str, expected: str) -> None:
    assert expected in error_of(tmp_path, overrides=[override])


# --------------------------------------------------------------------------- validation


def test_yaml_syntax_error_names_line(tmp_path: Path) -> None:
    path = write_job_file(tmp_path, "model: m\ninput:\n  path: [unclosed\noutput: {}\n")
    with pytest.raises(JobError, match=r"invalid YAML at line \d+, column \d+"):
        load_job(path)


def test_duplicate_key_is_an_error(tmp_path: Path) -> None:
    path = write_job_file(tmp_path, MINIMAL + "sampling:\n  n: 2\n  n: 3\n")
    with pytest.raises(JobError, match=r"line 8.*duplicate key 'n'"):
        load_job(path)


def test_missing_file_and_folder_and_non_mapping(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="not found"):
        load_job(tmp_path / "nope.yaml")
    with pytest.raises(JobError, match="is a folder"):
        load_job(tmp_path)
    with pytest.raises(JobError, match="expected a mapping"):
        load_job(write_job_file(tmp_path, "- a\n- b\n"))


def test_empty_file_names_the_required_keys(tmp_path: Path) -> None:
    with pytest.raises(JobError, match=r"missing required key 'model' \(and 2 more problems\)"):
        load_job(write_job_file(tmp_path, ""))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("input:\n  path: p\noutput:\n  path: o\n", "missing required key 'model'"),
        ("model: m\ninput: {}\noutput:\n  path: o\n", "missing required key 'input.path'"),
        ("model: m\ninput:\n  path: p\noutput: {}\n", "missing required key 'output.path'"),
        ("model: m\ninput:\n  path: p\n", "missing required key 'output'"),
    ],
)
def test_missing_required_keys(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(JobError) as info:
        load_job(write_job_file(tmp_path, text))
    assert expected in str(info.value)
    assert str(info.value).startswith(str(tmp_path / "job.yaml"))


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            {"sampling": {"temprature": 1}},
            "unknown key 'sampling.temprature' (did you mean 'temperature'?)",
        ),
        (
            {"engine": {"blocksize": 16}},
            "unknown key 'engine.blocksize' (did you mean 'block_size'?)",
        ),
        (
            {"input": {"prompt_col": "p"}},
            "unknown key 'input.prompt_col' (did you mean 'prompt_column'?)",
        ),
        ({"modle": "m"}, "unknown key 'modle' (did you mean 'model'?)"),
        (
            {"zzz": 1},
            "unknown key 'zzz' (valid keys: model, revision, input, output, sampling, engine, executor, storage)",
        ),
    ],
)
def test_unknown_keys_suggest(tmp_path: Path, extra: dict, expected: str) -> None:
    assert expected in error_of(tmp_path, extra)


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("sampling", "n", 0, "sampling.n: must be greater than or equal to 1 (got 0)"),
        ("sampling", "n", "2", "sampling.n: must be a valid integer (got '2')"),
        ("sampling", "n", True, "sampling.n: must be a valid integer (got True)"),
        ("sampling", "n", 1.5, "sampling.n: must be a valid integer"),
        ("sampling", "max_tokens", 0, "sampling.max_tokens: must be greater than or equal to 1"),
        (
            "sampling",
            "temperature",
            -0.1,
            "sampling.temperature: must be greater than or equal to 0",
        ),
        ("sampling", "temperature", "hot", "sampling.temperature: must be a valid number"),
        ("sampling", "temperature", float("inf"), "sampling.temperature: must be a finite number"),
        ("sampling", "top_p", 0, "sampling.top_p: must be greater than 0"),
        ("sampling", "top_p", 1.01, "sampling.top_p: must be less than or equal to 1"),
        ("sampling", "top_k", -1, "sampling.top_k: must be greater than or equal to 0"),
        ("sampling", "min_p", -0.1, "sampling.min_p: must be greater than or equal to 0"),
        ("sampling", "min_p", 1.5, "sampling.min_p: must be less than or equal to 1"),
        (
            "sampling",
            "repetition_penalty",
            0,
            "sampling.repetition_penalty: must be greater than 0",
        ),
        ("sampling", "presence_penalty", 2.5, "sampling.presence_penalty: must be less than"),
        ("sampling", "frequency_penalty", -3, "sampling.frequency_penalty: must be greater than"),
        ("sampling", "stop", ["ok", 3], "sampling.stop[1]: must be a valid string (got 3)"),
        ("sampling", "stop", [""], "sampling.stop[0]: must have at least 1 character"),
        ("sampling", "stop", {"a": 1}, "sampling.stop: must be a list"),
        ("sampling", "stop_token_ids", [-1], "sampling.stop_token_ids[0]: must be greater than"),
        ("sampling", "ignore_eos", "yes please", "sampling.ignore_eos: must be a valid boolean"),
        ("sampling", "seed", -1, "sampling.seed: must be greater than or equal to 0"),
        ("engine", "block_size", 24, "engine.block_size: must be a power of two (got 24)"),
        ("engine", "block_size", 0, "engine.block_size: must be greater than or equal to 1"),
        ("engine", "max_num_seqs", 0, "engine.max_num_seqs: must be greater than or equal to 1"),
        ("engine", "max_num_batched_tokens", 0, "engine.max_num_batched_tokens: must be greater"),
        ("engine", "max_model_len", 0, "engine.max_model_len: must be greater than or equal to 1"),
        ("engine", "kv_cache_blocks", 0, "engine.kv_cache_blocks: must be greater than or equal"),
        ("engine", "device", "gpu", "engine.device: must be auto, cpu, cuda or cuda:N (got 'gpu')"),
        ("engine", "device", "cuda:x", "engine.device: must be auto, cpu, cuda or cuda:N"),
        (
            "engine",
            "dtype",
            "fp16",
            "engine.dtype: must be 'auto', 'float32', 'float16' or 'bfloat16'",
        ),
        (
            "engine",
            "attention_backend",
            "flash",
            "engine.attention_backend: must be 'auto', 'torch' or 'triton'",
        ),
        (
            "engine",
            "kv_cache_memory",
            "4 gigs",
            "engine.kv_cache_memory: must be a number of bytes",
        ),
        ("engine", "kv_cache_memory", 0, "engine.kv_cache_memory: must be at least 1 byte"),
        ("engine", "kv_cache_memory", True, "engine.kv_cache_memory: must be a number of bytes"),
        ("engine", "prefix_caching", 1, "engine.prefix_caching: must be a valid boolean"),
        ("input", "window_rows", 0, "input.window_rows: must be greater than or equal to 1"),
        ("input", "path", "", "input.path: must have at least 1 character"),
        ("input", "keep_columns", ["a", "a"], "input: keep_columns lists a column twice"),
        ("output", "commit_rows", 0, "output.commit_rows: must be greater than or equal to 1"),
        ("output", "commit_seconds", 0, "output.commit_seconds: must be greater than 0"),
    ],
)
def test_bad_values_name_the_key(
    tmp_path: Path, section: str, key: str, value: object, expected: str
) -> None:
    assert expected in error_of(tmp_path, {section: {key: value}})


def test_section_of_wrong_type(tmp_path: Path) -> None:
    assert "sampling: must be a mapping of keys (got 5)" in error_of(tmp_path, {"sampling": 5})


@pytest.mark.parametrize(
    ("input_extra", "expected"),
    [
        (
            {"messages_column": "m", "prompt_column": "p"},
            "set only one of prompt_column and messages_column",
        ),
        ({"prompt_column": None}, "set one of prompt_column and messages_column"),
    ],
)
def test_exactly_one_prompt_source(tmp_path: Path, input_extra: dict, expected: str) -> None:
    assert expected in error_of(tmp_path, {"input": input_extra})


def test_many_problems_are_counted(tmp_path: Path) -> None:
    message = error_of(tmp_path, {"sampling": {"n": 0, "top_p": 2}})
    assert message.endswith("(and 1 more problem)")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("auto", "auto"),
        (1024, 1024),
        ("4GiB", 4 << 30),
        ("4G", 4 << 30),
        ("4gb", 4_000_000_000),
        ("512MB", 512_000_000),
        ("512 MiB", 512 << 20),
        ("1.5KiB", 1536),
        ("100B", 100),
        ("100", 100),
        ("4e9", 4_000_000_000),
        (2.0e9, 2_000_000_000),
    ],
)
def test_parse_memory(value: object, expected: object) -> None:
    assert parse_memory(value) == expected


@pytest.mark.parametrize("value", ["", "GiB", "4 ib", "-1GiB", "4 XB", 0, -5, 1.5, None, [1]])
def test_parse_memory_rejects(value: object) -> None:
    with pytest.raises(ValueError):
        parse_memory(value)


# --------------------------------------------------------------------------- fingerprint


def test_fingerprint_covers_model_input_sampling_not_engine(tmp_path: Path) -> None:
    base = job_from(tmp_path)
    fp = fingerprint(base, "model-A", "files-A")
    assert set(fp) == {"model", "input", "sampling"}
    assert all(isinstance(v, str) and len(v) == 16 for v in fp.values())
    # The same job file read again (another object, same settings): the same fingerprint.
    assert fingerprint(job_from(tmp_path), "model-A", "files-A") == fp

    other_engine = job_from(
        tmp_path,
        overrides=[
            "engine.block_size=32",
            "engine.max_num_seqs=3",
            "output.commit_rows=5",
            "input.window_rows=7",
            "output.path=elsewhere",
        ],
    )
    assert fingerprint(other_engine, "model-A", "files-A") == fp

    def differing(job: Job, model: str = "model-A", inp: str = "files-A") -> str:
        return describe_fingerprint_mismatch(fp, fingerprint(job, model, inp))

    assert differing(base, model="model-B") == "model differs"
    assert differing(base, inp="files-B") == "input differs"
    assert differing(job_from(tmp_path, overrides=["input.keep_columns=[x]"])) == "input differs"
    assert differing(job_from(tmp_path, overrides=["input.id_column=null"])) == "input differs"
    assert differing(job_from(tmp_path, overrides=["sampling.seed=1"])) == "sampling differs"
    changed = job_from(tmp_path, overrides=["sampling.n=2"])
    assert differing(changed, inp="files-B") == "input, sampling differ"


def test_describe_mismatch_with_missing_keys() -> None:
    assert describe_fingerprint_mismatch({"model": "a"}, {"model": "a", "input": "b"}) == (
        "input differs"
    )
    assert describe_fingerprint_mismatch({"model": "a"}, {"model": "a"}) == "nothing differs"


@pytest.mark.parametrize(
    ("raw_model", "expected"),
    [(5, "model: must be a path (a string) (got 5)"), ("", "model: must not be empty")],
)
def test_bad_model_path(tmp_path: Path, raw_model: object, expected: str) -> None:
    assert expected in error_of(tmp_path, {"model": raw_model})


def test_null_section_is_a_type_error(tmp_path: Path) -> None:
    assert "input: must be a mapping of keys (got None)" in error_of(tmp_path, {"input": None})


def test_override_value_that_yaml_reads_as_comment(tmp_path: Path) -> None:
    job = job_from(tmp_path, overrides=["sampling.stop=###"])
    assert job.sampling.stop == ("###",)
    assert job_from(tmp_path, overrides=["sampling.stop="]).sampling.stop == ()


# --------------------------------------------------------------------------- structured.json_layout

SMALL_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("structured", "input_extra", "expected"),
    [
        (
            {"json": True, "json_layout": "pretty"},
            {},
            "sampling.structured.json_layout: must be 'auto' or 'compact' (got 'pretty')",
        ),
        (
            {"json": True, "json_layout": None},
            {},
            "sampling.structured.json_layout: must be 'auto' or 'compact' (got None)",
        ),
        (
            {"regex": "[ab]+", "json_layout": "auto"},
            {},
            "sampling.structured: json_layout applies to JSON outputs (json_schema, "
            "json_schema_file, json: true or input.schema_column), not to regex",
        ),
        ({"choice": ["x"], "json_layout": "compact"}, {}, "not to choice"),
        ({"grammar": "start: /a/", "json_layout": "compact"}, {}, "not to grammar"),
        (
            {"json_layout": "compact"},
            {},
            "sampling.structured.json_layout: there is no JSON output to lay out; set "
            "json_schema, json_schema_file or json: true beside it, or input.schema_column",
        ),
    ],
)
def test_bad_json_layout_is_one_line_naming_the_key(
    tmp_path: Path, structured: dict, input_extra: dict, expected: str
) -> None:
    extra = {"sampling": {"structured": structured}, "input": input_extra}
    message = error_of(tmp_path, extra)
    assert expected in message and "\n" not in message, message


def test_json_layout_defaults_to_auto_and_may_stand_alone_with_row_schemas(tmp_path: Path) -> None:
    job = job_from(tmp_path, {"sampling": {"structured": {"json_schema": SMALL_SCHEMA}}})
    assert job.sampling.structured.json_layout == "auto"
    alone = {"sampling": {"structured": {"json_layout": "compact"}}}
    job = job_from(tmp_path, {**alone, "input": {"schema_column": "s"}})
    assert job.sampling.structured.json_layout == "compact"
    assert job.sampling.structured.constraint_key is None
    job = job_from(tmp_path, {**alone, "input": {"format": "openai_batch"}})  # response_format
    assert job.sampling.structured.json_layout == "compact"
    over = ["sampling.structured.json=true", "sampling.structured.json_layout=compact"]
    job = job_from(tmp_path, overrides=over)
    assert (job.sampling.structured.constraint_key, job.sampling.structured.json_layout) == (
        "json",
        "compact",
    )


# The sampling fingerprints that batchgen recorded before json_layout existed (every JSON output
# was compact then), for the jobs of test_fingerprint_records_json_layout.
BEFORE_JSON_LAYOUT = {"json_schema": "ff92e2dd8226915d", "schema_column": "bf532c90293592e5"}
BEFORE_JSON_LAYOUT_REGEX = "29d68b9f3118a6d2"


def test_fingerprint_records_json_layout(tmp_path: Path) -> None:
    def sampling_fp(structured: dict | None, input_extra: dict | None = None) -> str:
        extra = {"sampling": {"structured": structured}, "input": input_extra or {}}
        return fingerprint(job_from(tmp_path, extra), "model-A", "files-A")["sampling"]

    # a job-level JSON constraint: the layouts differ; compact is what folders recorded before
    for key, value in [("json_schema", SMALL_SCHEMA), ("json", True)]:
        auto = sampling_fp({key: value})
        assert sampling_fp({key: value, "json_layout": "auto"}) == auto
        assert sampling_fp({key: value, "json_layout": "compact"}) != auto
    assert sampling_fp({"json_schema": SMALL_SCHEMA}) != BEFORE_JSON_LAYOUT["json_schema"]
    compact = {"json_schema": SMALL_SCHEMA, "json_layout": "compact"}
    assert sampling_fp(compact) == BEFORE_JSON_LAYOUT["json_schema"]
    # the rows' own schemas follow json_layout too
    rows = {"schema_column": "s"}
    assert sampling_fp(None, rows) != BEFORE_JSON_LAYOUT["schema_column"]
    assert sampling_fp({"json_layout": "auto"}, rows) == sampling_fp(None, rows)
    assert sampling_fp({"json_layout": "compact"}, rows) == BEFORE_JSON_LAYOUT["schema_column"]
    # constraints that are not JSON keep their fingerprints
    assert sampling_fp({"regex": "[ab]+"}) == BEFORE_JSON_LAYOUT_REGEX


def test_the_engine_sampling_params_mirror_the_sampling_section() -> None:
    # plan.sampling_params copies every SamplingParams field from sampling: by name, so each must
    # exist there with the same default; what only the job has is listed in JOB_ONLY_SAMPLING_KEYS
    # or compiled apart (structured).
    from dataclasses import fields

    from batchgen.engine.request import SamplingParams
    from batchgen.job import ROW_SAMPLING_KEYS, SamplingConfig

    defaults = SamplingConfig()
    engine = SamplingParams()
    assert {f.name for f in fields(SamplingParams)} == set(SamplingConfig.model_fields) - {
        "structured"
    }
    for f in fields(SamplingParams):
        assert getattr(engine, f.name) == getattr(defaults, f.name), f.name
    assert set(ROW_SAMPLING_KEYS) < {f.name for f in fields(SamplingParams)}
