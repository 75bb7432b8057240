"""Scoring in the engine: prompt logprobs of given tokens (score-only requests and generate
requests with prompt logprobs) and the top-K alternatives of sampled tokens, against
transformers' log-softmax; the LM head projects only the scored positions, in chunks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from batchgen.engine.logprobs import rows_per_chunk, token_logprobs, top_k_rows
from batchgen.engine.noise import rng_key
from batchgen.engine.request import Request, SampleTarget, SamplingParams
from tests.hf_reference import hf_logits
from tests.test_engine import make_engine, random_prompts


def _score(engine, prompts_and_starts):
    for row, (prompt, start) in enumerate(prompts_and_starts):
        target = SampleTarget(row, 0, rng_key(0, row, 0))
        engine.add(Request(tuple(prompt), SamplingParams(), (target,), logprobs_from=start,
                           score_only=True))  # fmt: skip
    out = {}
    while engine.has_work():
        for res in engine.step():
            out[res.target.row] = res
    engine.scheduler.cache.evict(engine.pool.num_blocks)
    assert engine.pool.num_free == engine.pool.num_blocks
    return out


def test_score_only_requests_equal_transformers_and_share_the_context(tiny_model):
    model = tiny_model()
    engine = make_engine(model)
    (context,) = random_prompts([21], seed=3)
    conts = random_prompts([4, 2, 6, 1], seed=4)
    seqs = [context + c[1:] + [c[0] + 5] for c in conts]  # continuations of 4, 2, 6, 1 tokens
    out = _score(engine, [(s, len(context)) for s in seqs])
    ref = hf_logits(model, seqs)
    for row, s in enumerate(seqs):
        res = out[row]
        assert res.token_ids == [] and res.num_prompt_tokens == len(s)
        want = torch.log_softmax(ref[row], dim=-1)
        expect = [want[p - 1, s[p]].item() for p in range(len(context), len(s))]
        got = [lp for lp, top in res.prompt_logprobs]
        assert len(got) == len(expect)
        assert max(abs(a - b) for a, b in zip(got, expect, strict=True)) <= 1e-4
    # the context is computed once: later rows reuse all of it but the last token
    assert out[0].num_cached_tokens == 0
    assert all(out[r].num_cached_tokens == len(context) - 1 for r in (1, 2, 3))


def test_prompt_logprobs_of_generate_requests_with_top_k(tiny_model):
    model = tiny_model()
    engine = make_engine(model)
    prompt = random_prompts([9], seed=5)[0]
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=True, top_logprobs=3,
                            prompt_logprobs=2)  # fmt: skip
    targets = (SampleTarget(0, 0, 1), SampleTarget(0, 1, 2))
    engine.add(Request(tuple(prompt), params, targets, logprobs_from=1, prompt_top_k=2))
    out = []
    while engine.has_work():
        out += engine.step()
    assert len(out) == 2
    res = out[0]
    (ref,) = hf_logits(model, [prompt + res.token_ids])
    want = torch.log_softmax(ref, dim=-1)
    for p, (lp, top) in enumerate(res.prompt_logprobs, start=1):
        assert abs(lp - want[p - 1, prompt[p]].item()) <= 1e-4
        values, ids = want[p - 1].topk(2)
        assert [t for t, _ in top] == ids.tolist()
        assert max(abs(v - w) for (_, v), w in zip(top, values.tolist(), strict=True)) <= 1e-4
    assert len(res.top_logprobs) == len(res.token_ids) == 3
    for i, top in enumerate(res.top_logprobs):
        values, ids = want[len(prompt) - 1 + i].topk(3)
        assert [t for t, _ in top] == ids.tolist()
        assert top[0][0] == res.token_ids[i]  # greedy: the top token is the drawn one
        assert abs(top[0][1] - res.token_logprobs[i]) <= 1e-6


def test_token_logprobs_projects_bounded_chunks():
    torch.manual_seed(0)
    vocab, hidden_size, positions = 5000, 8, 300
    head = torch.randn(vocab, hidden_size)
    seen: list[int] = []

    def lm_head(h):
        seen.append(h.shape[0])
        return h @ head.T

    hidden = torch.randn(positions, hidden_size)
    targets = torch.randint(0, vocab, (positions,))
    budget = 64 * vocab * 4  # 64 rows of logits per chunk
    lps, tops = token_logprobs(lm_head, hidden, targets, vocab, top_k=2, chunk_bytes=budget)
    assert max(seen) == rows_per_chunk(vocab, budget) == 64 and sum(seen) == positions
    full = torch.log_softmax(hidden @ head.T, dim=-1)
    assert torch.allclose(torch.tensor(lps), full.gather(1, targets[:, None])[:, 0], atol=1e-5)
    assert [[t for t, _ in top] for top in tops] == full.topk(2).indices.tolist()
    values, ids = top_k_rows(full, 3, chunk_bytes=5 * 16 * vocab)  # 5 rows at a time
    assert torch.equal(ids, full.topk(3).indices) and torch.equal(values, full.topk(3).values)


PEAK_SCRIPT = """
import resource, sys
from pathlib import Path
from tests.jobkit import invoke, write_job

model, tmp, prompt = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
peaks = []
for name, sampling in (("plain", {}), ("scored", {"prompt_logprobs": 5})):
    job = write_job(tmp, model, [prompt], sampling={"max_tokens": 1, **sampling},
                    engine={"kv_cache_memory": "64MiB"}, output=name, name=name + ".yaml")
    assert invoke("run", job, "--quiet").exit_code == 0
    peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
print(peaks[1] - peaks[0])
"""


@pytest.mark.slow
def test_prompt_logprobs_peak_memory_with_a_152k_vocabulary(tmp_path, tiny_model):
    """A 4k-token prompt's logprobs (top 5) over 152,064 tokens grow the job's peak memory by at
    most 256 MiB over the same job without them (measured: 85 to 135 MiB, see
    batchgen.engine.logprobs); all the logits at once would be 2.3 GiB."""
    model = tiny_model(vocab_size=152_064, hidden_size=32, num_heads=2, num_kv_heads=1,
                       intermediate_size=64, num_layers=1, max_position_embeddings=4200)  # fmt: skip
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    prompt = " ".join(words[(i * 7) % 10] + words[i % 3] for i in range(650))
    tokens = len(AutoTokenizer.from_pretrained(model)(prompt)["input_ids"])
    assert 3500 <= tokens < 4200
    out = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(model), str(tmp_path), prompt],
        capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    growth = int(out.stdout.split()[-1])
    assert growth <= 256 * 2**20, f"{growth / 2**20:.0f} MiB"


def test_score_only_requests_survive_preemption_and_overlapped_steps(tiny_model):
    """Few KV blocks, generating requests beside the scored ones (rows are preempted and
    recomputed) and overlapped steps: the same scores."""
    model = tiny_model()
    contexts = random_prompts([24, 20, 28, 22], seed=8)
    conts = random_prompts([5, 7], seed=9)
    seqs = [ctx + c for ctx in contexts for c in conts]
    starts = [len(ctx) for ctx in contexts for _ in conts]
    want = _score(make_engine(model), list(zip(seqs, starts, strict=True)))
    engine = make_engine(model, num_blocks=12, max_num_batched_tokens=16, overlap=True)
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0)
    for i, prompt in enumerate(random_prompts([6, 7, 5], seed=3)):
        engine.add(Request(tuple(prompt), params, (SampleTarget(100 + i, 0, 1),)))
    got = _score(engine, list(zip(seqs, starts, strict=True)))
    assert engine.scheduler.num_preemptions > 0
    assert len(got) == len(seqs) + 3
    for row in want:
        a = [lp for lp, _ in want[row].prompt_logprobs]
        b = [lp for lp, _ in got[row].prompt_logprobs]
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-4
