"""OpenAI Batch API files: request lines in (``input.format: openai_batch``), the batch output
JSONL out.

A request line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url``
``/v1/chat/completions`` (``body.messages``) or ``/v1/completions`` (``body.prompt``, a string).
Each line is read with ``json.loads``: the body's fields change their JSON type from line to line
(``stop`` a string or a list, ``content`` a string or a list of parts), which a columnar reader
cannot type. What the body asks for:

- ``custom_id`` is the row's id (a string, unique in the file); a line that is not a JSON
  object, lacks a string ``custom_id`` or repeats one makes the file invalid (exit 2, naming the
  file and line).
- Sampling fields become the row's sampling overrides, checked as ``sampling_columns`` values
  are (:data:`BODY_SAMPLING`; ``max_completion_tokens`` is ``max_tokens``). The job's
  ``sampling:`` gives what a body leaves out (also ``max_tokens``: 256 unless the job says
  otherwise).
- ``response_format``: ``text``; ``json_object`` (any JSON object); ``json_schema`` (its
  ``json_schema.schema``) becomes the row's structured-output schema.
- ``model`` is not checked: the job's model answers every line, and the output names it.
  :data:`BODY_IGNORED` fields are ignored. Anything else (``logprobs: true``, ``tools``,
  ``logit_bias``, a message with ``tool_calls``, a non-text content part, another url or method)
  makes that line an error row: its output line has ``error`` set, the job goes on.

The output (:func:`write_batch_output`) is built from the committed Parquet results, so it is the
same after any number of resumes: one line per request, in input order,
``{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error": null}``
with ``body`` a ``chat.completion`` or ``text_completion`` object (``choices[i].index`` is the
sample index), or ``{"id", "custom_id", "response": null, "error": {"code", "message"}}`` for a
line that could not run. Ids are derived from ``custom_id``, ``created`` is when the output
folder was created: nothing in it depends on when or how often the job ran.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Container, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds

from batchgen.errors import InputError

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
# body field -> sampling key
BODY_SAMPLING: dict[str, str] = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "n": "n",
    "stop": "stop",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    # vLLM's extra sampling parameters
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids",
}
# Accepted and ignored: bookkeeping of the caller, or settings that are already what we do.
BODY_IGNORED = ("model", "user", "metadata", "store", "service_tier", "stream_options")
# Accepted when false / null only.
BODY_FALSE_ONLY = ("stream", "logprobs", "echo")


@dataclass(frozen=True)
class BatchRequest:
    """One request line, read. ``problem``: why it cannot run (it becomes an error row)."""

    custom_id: str
    url: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    schema: str | None = None  # JSON schema text of response_format
    sampling: dict[str, Any] = field(default_factory=dict)  # sampling key -> body value
    problem: str | None = None


def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line number, object) of every non-blank line."""
    try:
        with open(path, "rb") as fh:
            for number, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                try:
                    value = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as err:
                    raise InputError(
                        f"input file {path} line {number} is not valid JSON: "
                        f"{' '.join(str(err).split())}"
                    ) from None
                if not isinstance(value, dict):
                    raise InputError(
                        f"input file {path} line {number} is not a JSON object (an OpenAI batch "
                        "file holds one request object per line)"
                    )
                custom_id = value.get("custom_id")
                if not isinstance(custom_id, str) or not custom_id:
                    raise InputError(
                        f"input file {path} line {number}: custom_id is "
                        f"{'missing' if custom_id is None else 'not a non-empty string'} "
                        "(every request needs a unique string custom_id)"
                    )
                yield number, value
    except OSError as err:
        raise InputError(f"cannot read input file {path}: {err.strerror or err}") from None


class _Problem(Exception):
    pass


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _Problem(f"{where}[{i}] is a {kind} part; only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise _Problem(f"{where}[{i}].text is not a string")
            parts.append(part["text"])
        return "".join(parts)
    raise _Problem(f"{where} is not a string or a list of text parts")


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _Problem("body.messages is not a non-empty list")
    out = []
    for i, m in enumerate(value):
        where = f"body.messages[{i}]"
        if not isinstance(m, dict):
            raise _Problem(f"{where} is not an object")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise _Problem(f"{where}.{extra[0]} is not supported")
        if not isinstance(m.get("role"), str):
            raise _Problem(f"{where}.role is not a string")
        out.append(
            {"role": m["role"], "content": _text_content(m.get("content"), where + ".content")}
        )
    return out


def _schema(value: Any) -> str | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _Problem("body.response_format.json_schema.schema is not a JSON object")
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    raise _Problem(f"body.response_format type {kind!r} is not supported")


def parse_request(line: Mapping[str, Any]) -> BatchRequest:
    """A request line (an object with a string ``custom_id``) as a :class:`BatchRequest`."""
    custom_id = str(line["custom_id"])
    url = line.get("url")
    try:
        if line.get("method", "POST") != "POST":
            raise _Problem(f"method {line.get('method')!r} is not supported (only POST)")
        if url not in (CHAT_URL, COMPLETIONS_URL):
            raise _Problem(f"url {url!r} is not supported (only {CHAT_URL} and {COMPLETIONS_URL})")
        extra = sorted(set(line) - {"custom_id", "method", "url", "body"})
        if extra:
            raise _Problem(f"request field {extra[0]!r} is not supported")
        body = line.get("body")
        if not isinstance(body, dict):
            raise _Problem("body is not an object")
        prompt_key = "messages" if url == CHAT_URL else "prompt"
        sampling: dict[str, Any] = {}
        for key, value in body.items():
            if key == prompt_key or key == "response_format" or key in BODY_IGNORED:
                continue
            if key in BODY_FALSE_ONLY:
                if value not in (None, False):
                    raise _Problem(f"body.{key}: {value!r} is not supported")
                continue
            if key not in BODY_SAMPLING:
                raise _Problem(f"body.{key} is not supported")
            if value is not None:
                if BODY_SAMPLING[key] in sampling:
                    raise _Problem(f"body.{key} repeats {BODY_SAMPLING[key]}")
                sampling[BODY_SAMPLING[key]] = value
        schema = _schema(body.get("response_format"))
        if url == CHAT_URL:
            return BatchRequest(
                custom_id,
                url,
                messages=_messages(body.get("messages")),
                schema=schema,
                sampling=sampling,
            )
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise _Problem("body.prompt is not a string (one prompt per request)")
        return BatchRequest(custom_id, url, prompt=prompt, schema=schema, sampling=sampling)
    except _Problem as problem:
        return BatchRequest(custom_id, str(url), problem=str(problem))


class OpenAIBatchInput:
    """The request lines of OpenAI batch files: ``num_rows``, ``identity`` (the files' paths,
    sizes and mtimes), custom_ids proven unique; :meth:`rows` streams them."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files
        seen: dict[str, tuple[Path, int]] = {}
        identity = []
        for path in files:
            for number, line in _lines(path):
                cid = line["custom_id"]
                if cid in seen:
                    first = seen[cid]
                    raise InputError(
                        f"input file {path} line {number}: custom_id {cid!r} repeats line "
                        f"{first[1]}{'' if first[0] == path else f' of {first[0]}'}"
                    )
                seen[cid] = (path, number)
            stat = path.stat()
            identity.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns, "openai_batch"])
        self.num_rows = len(seen)
        self.identity = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:32]

    def rows(self, skip_ids: Container[Any] = ()) -> Iterator[BatchRequest]:
        """The requests in file order, but those whose custom_id is in ``skip_ids``."""
        for path in self.files:
            for _, line in _lines(path):
                if line["custom_id"] not in skip_ids:
                    yield parse_request(line)


# --------------------------------------------------------------------------- output


def _stable_id(prefix: str, custom_id: str) -> str:
    return prefix + hashlib.sha256(custom_id.encode()).hexdigest()[:24]


def _results(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """The committed result rows of a finished job, grouped by id, in sample order."""
    columns = ["id", "sample_index", "text", "finish_reason", "error"]
    columns += ["num_prompt_tokens", "num_output_tokens"]
    table = ds.dataset(folder, format="parquet").to_table(columns=columns)
    grouped: dict[str, list[dict[str, Any]]] = {}
    for row in table.to_pylist():
        grouped.setdefault(row["id"], []).append(row)
    for rows in grouped.values():
        rows.sort(key=lambda r: r["sample_index"])
    return grouped


def _output_line(
    request: BatchRequest, rows: list[dict[str, Any]], model: str, created: int
) -> dict[str, Any]:
    cid = request.custom_id
    failed = [r for r in rows if r["finish_reason"] == "error" and not r["num_prompt_tokens"]]
    if not rows or len(failed) == len(rows):
        message = failed[0]["error"] if failed else "no result was generated"
        return {
            "id": _stable_id("batch_req_", cid),
            "custom_id": cid,
            "response": None,
            "error": {"code": "invalid_request", "message": message},
        }
    chat = request.url == CHAT_URL
    choices = []
    for r in rows:
        choice: dict[str, Any] = {"index": r["sample_index"]}
        if chat:
            choice["message"] = {"role": "assistant", "content": r["text"]}
        else:
            choice["text"] = r["text"]
        choice["logprobs"] = None
        choice["finish_reason"] = r["finish_reason"]
        choices.append(choice)
    prompt_tokens = max(r["num_prompt_tokens"] for r in rows)
    completion_tokens = sum(r["num_output_tokens"] for r in rows)
    body = {
        "id": _stable_id("chatcmpl-" if chat else "cmpl-", cid),
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    return {
        "id": _stable_id("batch_req_", cid),
        "custom_id": cid,
        "response": {
            "status_code": 200,
            "request_id": _stable_id("req_", cid),
            "body": body,
        },
        "error": None,
    }


def write_batch_output(
    inputs: OpenAIBatchInput, results: Path, out: Path, model: str, created: int
) -> int:
    """Write the batch output JSONL of a finished job to ``out`` (atomically: a temp file, then
    a rename); return the number of lines. ``results``: the output folder, whose committed parts
    hold every request's rows."""
    grouped = _results(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.with_name(f".{out.name}.tmp")
    count = 0
    with open(temp, "w", encoding="utf-8") as fh:
        for request in inputs.rows():
            line = _output_line(request, grouped.get(request.custom_id, []), model, created)
            fh.write(json.dumps(line, ensure_ascii=False) + "\n")
            count += 1
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(temp, out)
    return count


__all__ = [
    "BODY_IGNORED",
    "BODY_SAMPLING",
    "CHAT_URL",
    "COMPLETIONS_URL",
    "BatchRequest",
    "OpenAIBatchInput",
    "parse_request",
    "write_batch_output",
]
