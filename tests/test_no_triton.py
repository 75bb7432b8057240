"""The torch path (CPU) runs where Triton cannot be imported: nothing on it imports Triton."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

SCRIPT = textwrap.dedent(
    """
    import sys

    sys.modules["triton"] = None  # any `import triton` now raises ImportError

    import torch

    import batchgen.kernels.reference  # the PyTorch twins need no Triton
    from batchgen.engine.engine import Engine, EngineSettings
    from batchgen.engine.request import Request, SampleTarget, SamplingParams
    from batchgen.engine.noise import rng_key
    from batchgen.model.attention import make_attention_backend
    from batchgen.model.loader import load_model
    from batchgen.tiny_model import make_tiny_model

    cpu = torch.device("cpu")
    model_dir = make_tiny_model(sys.argv[1], "llama", num_layers=1)
    model, info = load_model(model_dir, cpu, torch.float32, make_attention_backend("torch"))
    config = EngineSettings(
        block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
        max_model_len=info.max_model_len, attention_backend="torch",
    )
    engine = Engine(model, info, config, device=cpu, dtype=torch.float32)
    copies = []
    copy = engine.copy_blocks
    engine.copy_blocks = lambda kv, src, dst: (copies.append(len(src)), copy(kv, src, dst))
    params = SamplingParams(temperature=1.0, max_tokens=3, n=2, seed=0)
    # 6 prompt tokens: the two samples fork inside the second block (copy-on-write)
    targets = tuple(SampleTarget(0, k, rng_key(0, 0, k)) for k in range(2))
    engine.add(Request((1, 9, 10, 11, 12, 13), params, targets))
    results = []
    while engine.has_work():
        results += engine.step()
    assert sorted(r.target.sample_index for r in results) == [0, 1], results
    assert all(len(r.token_ids) == 3 for r in results)
    assert copies, "no block was copied"
    assert "triton" not in [m for m, v in sys.modules.items() if v is not None]
    print("ok")
    """
)


def test_torch_path_runs_without_triton(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "model")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_torch_block_copy_matches_reference() -> None:
    from batchgen.kernels.reference import copy_blocks_ref
    from batchgen.model.block_copy import copy_blocks

    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(2, 2, 9, 4, 2, 8, generator=gen)
    expected = kv_cache.clone()
    src, dst = torch.tensor([3, 0, 5]), torch.tensor([7, 2, 8])
    copy_blocks_ref(expected, src, dst)
    copy_blocks(kv_cache, src, dst)
    assert torch.equal(kv_cache, expected)
    copy_blocks(kv_cache, src[:0], dst[:0])
    assert torch.equal(kv_cache, expected)
