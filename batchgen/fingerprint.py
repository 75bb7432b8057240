"""A job's fingerprint: what decides its results, recorded in the output folder's manifest.

A resume is allowed only into a folder of the same fingerprint. It covers the model (config,
weights, tokenizer), the input files and column settings, the sampling settings, and the numerics
the engines resolved (``numerics``: ``dtype=...,kv_cache_dtype=...``); the other engine, executor and output settings
change how, not what, so a job may resume with others.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from batchgen.errors import JobError
from batchgen.job import JSON_KEYS, Job

FINGERPRINT_KEYS = ("model", "input", "sampling", "numerics")
# Kept readable rather than hashed: a mismatch names both values.
_PLAIN_KEYS = ("numerics",)


def _digest(obj: Any) -> str:
    data = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(data.encode()).hexdigest()[:16]


def numerics(dtype: str, kv_cache_dtype: str | None = None) -> str:
    """The numerics a job runs with, resolved (never ``auto``), as the fingerprint records them:
    ``dtype=float32,kv_cache_dtype=int8``. ``kv_cache_dtype`` None: the same as ``dtype``."""
    values = {"dtype": dtype, "kv_cache_dtype": kv_cache_dtype or dtype}
    return ",".join(f"{k}={v}" for k, v in values.items())


def upgrade_numerics(text: str) -> str:
    """A recorded numerics text in today's form: folders written before the KV cache could be
    quantized recorded ``dtype=X`` alone, and their cache was of dtype X
    (``dtype=X,kv_cache_dtype=X``). Other texts are returned as they are."""
    values = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
    if set(values) != {"dtype"}:
        return text
    return numerics(values["dtype"])


def fingerprint(
    job: Job,
    model_identity: str,
    input_identity: str,
    numerics: str | None = None,
) -> dict[str, str]:
    """What decides a job's results, as short hashes under ``model``, ``input``, ``sampling``,
    and under ``numerics`` (when given, see :func:`numerics`) the resolved numerics as text,
    e.g. ``dtype=float32,kv_cache_dtype=float32``.

    ``model_identity`` (config, weights, tokenizer) and ``input_identity`` (the files) come from
    whoever inspected them; the input column settings are added here. The other engine settings,
    executor and output settings are deliberately left out: they change how, not what, so a job
    may resume with others.
    """
    columns = {
        "prompt_column": job.input.prompt_column,
        "messages_column": job.input.messages_column,
        "id_column": job.input.id_column,
        "keep_columns": list(job.input.keep_columns),
    }
    if job.input.schema_column is not None:  # absent otherwise: older folders keep resuming
        columns["schema_column"] = job.input.schema_column
    if job.input.sampling_columns:  # the format of each file is in input_identity
        columns["sampling_columns"] = dict(sorted(job.input.sampling_columns.items()))
    # keys added later are recorded only when set: older folders keep resuming
    for key in ("choices_column", "completion_column"):
        if getattr(job.input, key) is not None:
            columns[key] = getattr(job.input, key)
    if job.input.chat_template_kwargs:
        columns["chat_template_kwargs"] = job.input.chat_template_kwargs
    fp = {
        "model": _digest(model_identity),
        "input": _digest({"identity": input_identity, "columns": columns}),
        "sampling": _digest(_sampling(job)),
    }
    if numerics is not None:
        fp["numerics"] = numerics
    return fp


def _sampling(job: Job) -> dict[str, Any]:
    """The sampling settings as the fingerprint records them: ``structured`` only when set (so
    folders from before structured outputs resume), a schema file by its content, not its path.

    ``json_layout`` is recorded for jobs with JSON outputs (a JSON key or input.schema_column),
    except ``compact``: that was the only layout before the key existed, so folders written then
    resume with ``json_layout: compact`` and refuse the default (their rows are compact)."""
    if job.task == "score":  # no sampling section: the task decides the results
        return {"task": "score"}
    sampling = job.sampling.model_dump(mode="json", exclude={"structured", "prompt_logprobs"})
    if job.sampling.wants_logprobs and job.sampling.top_logprobs == 0:
        sampling["logprobs"] = True  # logprobs: 0 means true
    if job.sampling.prompt_logprobs is not None:
        sampling["prompt_logprobs"] = job.sampling.prompt_logprobs
    if job.output.reasoning != "auto":
        sampling["reasoning"] = job.output.reasoning
    structured = job.sampling.structured
    spec: dict[str, Any] = {}
    if structured is not None:
        spec = structured.model_dump(
            mode="json", by_alias=True, exclude_defaults=True, exclude={"json_layout"}
        )
        if structured.json_schema_file is not None:
            path = structured.json_schema_file
            try:
                spec["json_schema_file"] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
            except OSError as err:
                raise JobError(
                    f"sampling.structured.json_schema_file: cannot read {path}: "
                    f"{err.strerror or err}"
                ) from None
    layout = structured.json_layout if structured is not None else "auto"
    json_output = job.input.schema_column is not None or (
        structured is not None and structured.constraint_key in JSON_KEYS
    )
    if json_output and layout != "compact":
        spec["json_layout"] = layout
    if spec:  # empty for json_layout: compact alone, recorded as before the key existed
        sampling["structured"] = spec
    return sampling


def describe_fingerprint_mismatch(old: Mapping[str, str], new: Mapping[str, str]) -> str:
    """``"sampling, input differ"``-style text naming the parts of two fingerprints that differ
    (a key present in only one of them differs)."""
    keys = [k for k in FINGERPRINT_KEYS if k in old or k in new]
    keys += sorted(k for k in {*old, *new} if k not in FINGERPRINT_KEYS)
    differing = [k for k in keys if old.get(k) != new.get(k)]
    if not differing:
        return "nothing differs"
    text = f"{', '.join(differing)} differ{'s' if len(differing) == 1 else ''}"
    shown = [
        f"{k}: {old.get(k) or 'not recorded'} in the folder, {new.get(k) or 'not recorded'} now"
        for k in differing
        if k in _PLAIN_KEYS
    ]
    return f"{text} ({'; '.join(shown)})" if shown else text
