"""Errors that the CLI turns into one clear line and exit code 2 (SPEC: "the job, its input or
its model is invalid"). Anything else is a bug: exit 1 with a log file."""

from __future__ import annotations


class BatchgenError(Exception):
    """A problem the user can fix; ``str(err)`` is the one line the CLI prints."""


class JobError(BatchgenError):
    """The job file, a --set override, or the output folder is invalid."""


class InputError(BatchgenError):
    """The input Parquet files or their columns are invalid."""


class ModelError(BatchgenError):
    """The model folder (config, weights, tokenizer) is missing, corrupt or unsupported."""
