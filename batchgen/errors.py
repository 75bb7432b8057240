"""Errors that the CLI turns into one clear line: exit code 2 for a BatchgenError
(docs/job-file.md: "the job, its input or its model is invalid"), 1 for an OutputFullError.
Anything else is a bug: exit 1 with a log file."""

from __future__ import annotations


class BatchgenError(Exception):
    """A problem the user can fix; ``str(err)`` is the one line the CLI prints."""


class JobError(BatchgenError):
    """The job file, a --set override, or the output folder is invalid."""


class InputError(BatchgenError):
    """The input Parquet files or their columns are invalid."""


class ModelError(BatchgenError):
    """The model folder (config, weights, tokenizer) is missing, corrupt or unsupported."""


class OutputFullError(Exception):
    """The output folder's disk or quota is full. Not a BatchgenError, since the job is valid:
    the CLI prints ``str(err)`` (one line naming the folder and the rows saved) and exits 1,
    without a traceback log. What was committed stays; running again resumes."""
