"""Shared test setup.

Triton kernels run under Triton's CPU interpreter when no GPU is present; the variable must be set
before any module decorated with @triton.jit is imported, hence here at the top.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))
