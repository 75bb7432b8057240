"""Reading a job file: YAML in, a validated :class:`~batchgen.job.Job` out.

:func:`load_job` reads the file (a key given twice is an error), applies ``--set KEY=VALUE``
overrides, validates it against the schema of :mod:`batchgen.job` and makes its paths absolute.
Every problem becomes a :class:`~batchgen.errors.JobError` whose message is one line that names
the key, e.g. ``unknown key 'sampling.temprature' (did you mean 'temperature'?)``: pydantic's
errors are rewritten into such lines here, and nowhere else (:func:`pydantic_message`).
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from batchgen.errors import JobError
from batchgen.job import HUB_ID_RE, Job

# --------------------------------------------------------------------------- loading


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe YAML loader that rejects a key given twice in one mapping (PyYAML keeps the last,
    silently, which hides exactly the kind of mistake the job file must not hide)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml_error_line(err: yaml.YAMLError) -> str:
    """One line out of PyYAML's multi-line message, with the (1-based) line and column."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return problem


def load_job(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> Job:
    """Read a job file, apply ``--set KEY=VALUE`` overrides, validate, resolve relative paths.

    Overrides use dotted keys (``engine.block_size=32``); the value is parsed as YAML, so
    ``sampling.stop=["\\n"]`` sets a list. Relative paths (``model``, ``input.path``,
    ``output.path``), also those given by ``--set``, resolve against the job file's folder.

    Raises JobError (one line naming the file or key) for any problem.
    """
    job_path = Path(path)
    try:
        text = job_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JobError(f"job file {job_path} not found") from None
    except IsADirectoryError:
        raise JobError(f"job file {job_path} is a folder, not a YAML file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise JobError(f"cannot read job file {job_path}: {err}") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise JobError(f"job file {job_path}: invalid YAML at {_yaml_error_line(err)}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise JobError(
            f"job file {job_path}: expected a mapping of keys (model, input, output, ...), "
            f"got a {type(raw).__name__}"
        )
    for override in overrides:
        raw = apply_override(raw, override)
    job = parse_job(raw, source=str(job_path))
    return _resolve_paths(job, job_path.absolute().parent)


def parse_job(raw: Mapping[str, Any], source: str = "job") -> Job:
    """Validate a job given as a dict (paths are left as given). Raises JobError."""
    try:
        return Job.model_validate(raw)
    except ValidationError as err:
        # An unknown key first: a typo ("modle") also makes the key it misspells "missing", and
        # the unknown key, with its suggestion, is the line that tells the user what to fix.
        errors = sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden")
        line = _format_error(errors[0])
        if len(errors) > 1:
            more = len(errors) - 1
            line += f" (and {more} more problem{'s' if more > 1 else ''})"
        raise JobError(f"{source}: {line}") from None


def apply_override(raw: dict[str, Any], override: str) -> dict[str, Any]:
    """Return a copy of ``raw`` with one ``KEY=VALUE`` override applied (see :func:`load_job`).

    The key must name a key of the schema (so a typo fails here, with a suggestion); the value
    is validated later with the rest of the job.
    """
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise JobError(f"--set {override!r}: expected KEY=VALUE, e.g. engine.block_size=32")
    parts = key.split(".")
    model: type[BaseModel] | None = Job
    for depth, part in enumerate(parts):
        if model is None or part not in _keys(model):
            prefix = ".".join(parts[:depth])
            raise JobError(f"--set {override!r}: {_unknown_key(prefix, part, model)}")
        model = _submodel(_keys(model)[part].annotation)
    try:
        value = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise JobError(f"--set {override!r}: invalid YAML value: {_yaml_error_line(err)}") from None
    if value is None and text.strip() not in ("", "~", "null", "Null", "NULL"):
        value = text  # e.g. "sampling.stop=###": YAML reads a comment, the user means the text

    result = dict(raw)
    node = result
    for part in parts[:-1]:
        child = node.get(part)
        # A section given as null (or something else) is replaced by a fresh mapping: the
        # override names a key inside it, so the user means a mapping there.
        child = dict(child) if isinstance(child, dict) else {}
        node[part] = child
        node = child
    node[parts[-1]] = value
    return result


def _resolve_paths(job: Job, base: Path) -> Job:
    """Make ``model``, ``input.path``, ``output.path`` and
    ``sampling.structured.json_schema_file`` absolute, relative to ``base``."""

    def absolute(p: str | Path) -> str:
        if isinstance(p, str) and p.startswith("s3://"):
            return p
        return os.path.normpath(base / Path(p).expanduser())

    def model_path(p: Path) -> Path:
        # org/name that is not a local path is a hub id: kept as given (a .gguf is a file)
        local = Path(absolute(p))
        text = p.as_posix()
        hub = HUB_ID_RE.match(text) and p.suffix.lower() != ".gguf"
        if not p.is_absolute() and hub and not local.exists():
            return p
        return local

    sampling = job.sampling
    structured = sampling.structured
    if structured is not None and structured.json_schema_file is not None:
        schema_file = Path(absolute(structured.json_schema_file))
        structured = structured.model_copy(update={"json_schema_file": schema_file})
        sampling = sampling.model_copy(update={"structured": structured})
    return job.model_copy(
        update={
            "model": model_path(job.model),
            "input": job.input.model_copy(update={"path": absolute(job.input.path)}),
            "output": job.output.model_copy(
                update={"path": _as_output_path(absolute(job.output.path))}
            ),
            "sampling": sampling,
        }
    )


def _as_output_path(text: str) -> Path | str:
    return text if text.startswith("s3://") else Path(text)


# --------------------------------------------------------------------------- error lines


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The section model behind a field's annotation (also an optional one), or None for a
    leaf value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    models = [a for a in typing.get_args(annotation) if _submodel(a) is not None]
    return models[0] if len(models) == 1 else None


def _keys(model: type[BaseModel]) -> dict[str, Any]:
    """The keys of a section as the job file spells them (aliases), each with its field."""
    return {field.alias or name: field for name, field in model.model_fields.items()}


def _model_at(loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The section model reached by following ``loc`` from the top of the job."""
    model: type[BaseModel] | None = Job
    for part in loc:
        if model is None or not isinstance(part, str) or part not in _keys(model):
            return None
        model = _submodel(_keys(model)[part].annotation)
    return model


def _unknown_key(prefix: str, name: str, model: type[BaseModel] | None) -> str:
    """``unknown key 'a.b' (did you mean 'c'?)``, or the valid keys when nothing is close."""
    full = f"{prefix}.{name}" if prefix else name
    if model is None:
        return f"unknown key '{full}' ('{prefix}' has no sub-keys)"
    valid = list(_keys(model))
    close = difflib.get_close_matches(str(name), valid, n=1, cutoff=0.6)
    if close:
        return f"unknown key '{full}' (did you mean '{close[0]}'?)"
    return (
        f"unknown key '{full}' (valid keys{' of ' + prefix if prefix else ''}: {', '.join(valid)})"
    )


def _loc_str(loc: Sequence[str | int]) -> str:
    """``('sampling', 'stop', 0)`` -> ``sampling.stop[0]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def pydantic_message(err: Mapping[str, Any]) -> str:
    """A pydantic error's message in the job file's words (the key and value are added by the
    caller): ``Input should be greater than 0`` -> ``must be greater than 0``."""
    msg = str(err["msg"])
    msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    # Pydantic says "Input should be ...": "input" is also a section of ours, so say "must be".
    for lead in ("Input should", "String should", "List should", "Tuple should"):
        if msg.startswith(lead):
            msg = "must" + msg[len(lead) :]
    msg = msg.replace("a valid tuple", "a list")  # YAML users write lists
    msg = re.sub(r"a valid dictionary or instance of \w+", "a mapping of keys", msg)
    return msg[:1].lower() + msg[1:]


def _format_error(err: Mapping[str, Any]) -> str:
    """One pydantic error as one line naming the key."""
    loc = tuple(err["loc"])
    key = _loc_str(loc)
    if err["type"] == "extra_forbidden":
        parent = loc[:-1]
        return _unknown_key(_loc_str(parent), str(loc[-1]), _model_at(parent))
    if err["type"] == "missing":
        return f"missing required key '{key}'"
    msg = pydantic_message(err)
    value = err.get("input")
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    if key:
        return f"{key}: {msg} (got {shown})" if not isinstance(value, Mapping) else f"{key}: {msg}"
    return msg


__all__ = ["apply_override", "load_job", "parse_job", "pydantic_message"]
