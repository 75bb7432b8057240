"""The real model of the tests: SmolLM2-135M-Instruct as a Q4_1 GGUF file, fetched once per
machine by scripts/fetch_real_model.py (the demo uses the same fetch and cache).

Tests call :func:`gguf`: it fails the test when the file cannot be fetched, unless
``BATCHGEN_TEST_ALLOW_MISSING`` names ``real_model`` (tests/optional.py).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fetch_real_model.py"


def _fetcher():
    spec = importlib.util.spec_from_file_location("fetch_real_model", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def fetched() -> Path | None:
    """The .gguf path, fetched if need be; None when the fetch failed (the reason is printed)."""
    fetcher = _fetcher()
    try:
        return fetcher.fetch()
    except Exception as err:  # any failure means the path is missing; require() says so
        print(f"real model: {err}")
        return None


def gguf() -> Path:
    """The real model's .gguf file; the calling test fails (or skips, when opted out) without it."""
    from tests import optional

    optional.require("real_model")
    path = fetched()
    assert path is not None
    return path
