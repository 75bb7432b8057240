"""The real model (SmolLM2-135M-Instruct, the Q4_1 GGUF of tests/real_model.py) through the CLI,
against transformers reading the same file.

Greedy parity is checked teacher-forced: transformers runs each of batchgen's samples (prompt +
output) in one forward pass, and at every output position batchgen's token must be
transformers' argmax given the same prefix (so transformers' greedy ``generate`` would write the
same tokens), and a sample that stopped must end on the chat template's end token. A position
where the two top logits are within tests/ties.py's epsilon is a near-tie: counted and exempt,
the rest of that sample is not compared. One forward pass per sample instead of one per token
keeps this affordable on two cores (``generate`` over 48 prompts took minutes).
"""

from __future__ import annotations

import functools
import itertools

import pyarrow as pa
import pytest
import torch

from tests import real_model, ties
from tests.hf_reference import hf_model
from tests.jobkit import read_results, run_cli, write_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NUM_PROMPTS = 48
MAX_TOKENS = 24
_SUBJECTS = ("the moon", "bread", "rivers", "bicycles", "libraries", "bees", "glass", "maps",
             "volcanoes", "coffee", "trains", "paper")  # fmt: skip
_ASKS = (
    "Explain in two sentences why {s} matter to people who live in small towns, and give one "
    "example that a child could understand.",
    "Write a short, friendly note to a neighbour about {s}. Mention the weather, a date next "
    "week and one question you would like them to answer.",
    "List three surprising facts about {s}. Keep each fact under fifteen words and number "
    "them from one to three.",
    "Describe {s} to someone who has never seen or heard of them, using only simple words "
    "and at most three sentences.",
)


def chat_messages() -> list[list[dict[str, str]]]:
    pairs = itertools.islice(itertools.product(_ASKS, _SUBJECTS), NUM_PROMPTS)
    return [[{"role": "user", "content": ask.format(s=s)}] for ask, s in pairs]


@functools.cache
def tokenizer():
    from batchgen.model.loader import load_tokenizer

    return load_tokenizer(real_model.gguf())


def prompt_ids(messages) -> list[int]:
    tok = tokenizer()
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def run(tmp_path, name: str, **engine) -> list[dict]:
    table = pa.table(
        {
            "id": list(range(NUM_PROMPTS)),
            "messages": chat_messages(),
        }
    )
    job = write_job(
        tmp_path / name,
        real_model.gguf(),
        table=table,
        input_extra={"messages_column": "messages"},
        sampling={"temperature": 0, "max_tokens": MAX_TOKENS, "logprobs": True},
        engine=engine,
    )
    run_cli("run", str(job), "--quiet")
    return read_results(job.parent / "out")


@pytest.fixture(scope="module")
def float32_rows(tmp_path_factory) -> list[dict]:
    return run(tmp_path_factory.mktemp("real-f32"), "f32", dtype="float32")


def teacher_forced(hf, rows: list[dict], batch: int = 16) -> list[torch.Tensor]:
    """transformers' log-softmax [num_output_tokens, V] over each row's output positions."""
    seqs = [prompt_ids(chat_messages()[r["id"]]) + list(r["token_ids"]) for r in rows]
    out: list[torch.Tensor] = []
    for start in range(0, len(seqs), batch):
        chunk = seqs[start : start + batch]
        width = max(len(s) for s in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, s in enumerate(chunk):  # right padding: causal positions before it are unchanged
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        with torch.no_grad():
            logits = hf(input_ids=ids, attention_mask=mask).logits.float()
        for i, r in enumerate(rows[start : start + batch]):
            n, p = len(r["token_ids"]), len(chunk[i]) - len(r["token_ids"])
            out.append(torch.log_softmax(logits[i, p - 1 : p - 1 + n], dim=-1))
    return out


def greedy_agreement(rows, logps, eos: int) -> tuple[int, int, int]:
    """(positions agreeing, near-tie exemptions, samples) of batchgen's greedy tokens against
    the reference's argmax; asserts there is no other difference."""
    agree = exempt = 0
    failures = []
    for row, logp in zip(rows, logps, strict=True):
        tokens = list(row["token_ids"])
        for pos, token in enumerate(tokens):
            top2 = torch.topk(logp[pos], 2)
            if int(top2.indices[0]) == token:
                agree += 1
                continue
            gap = float(top2.values[0] - logp[pos, token])
            if gap <= ties.TIE_EPS * max(1.0, float(top2.values[0].abs())):
                exempt += 1
            else:
                failures.append(f"id {row['id']} position {pos}: {token} vs {top2.indices[0]}")
            break
        else:
            ended = tokens and tokens[-1] == eos
            assert (row["finish_reason"] == "stop") == bool(ended), row["id"]
    assert not failures, failures[:5]
    assert exempt <= ties.MAX_SHARE * len(rows), exempt
    ties.STATS.add(ties.TieStats(samples=len(rows), exempt=exempt, positions=agree))
    return agree, exempt, len(rows)


def test_prompts_are_chat_prompts_of_48_tokens_or_more():
    lengths = [len(prompt_ids(m)) for m in chat_messages()]
    assert len(lengths) == 48 and min(lengths) >= 48, lengths


def test_greedy_equals_transformers_float32(float32_rows):
    eos = tokenizer().convert_tokens_to_ids("<|im_end|>")
    assert len(float32_rows) == NUM_PROMPTS
    for row in float32_rows:
        assert row["num_prompt_tokens"] == len(prompt_ids(chat_messages()[row["id"]]))
        assert "<|im_end|>" not in row["text"]
    hf = hf_model(real_model.gguf(), torch.float32)
    logps = teacher_forced(hf, float32_rows)
    agree, exempt, samples = greedy_agreement(float32_rows, logps, eos)
    assert agree >= samples * MAX_TOKENS / 2  # not vacuous: the samples run long
    # batchgen's own logprobs of its tokens equal transformers' (float32 tolerance)
    diffs = [
        abs(float(lp[pos, tok]) - float(got))
        for row, lp in zip(float32_rows, logps, strict=True)
        for pos, (tok, got) in enumerate(zip(row["token_ids"], row["token_logprobs"], strict=True))
    ]
    assert max(diffs) < 2e-3, max(diffs)
    stopped = sum(r["finish_reason"] == "stop" for r in float32_rows)
    print(f"real model float32: {agree} positions agree, {exempt} near-ties, {stopped} stopped")


def _logprob_gap(a: list[dict], b: list[dict]) -> tuple[float, float, float]:
    """(share of samples with identical tokens, share of positions agreeing up to each
    sample's first difference, mean |logprob difference| over those positions)."""
    same = positions = agreeing = 0
    total = 0.0
    for x, y in zip(a, b, strict=True):
        same += x["token_ids"] == y["token_ids"]
        n = next(
            (i for i, (s, t) in enumerate(zip(x["token_ids"], y["token_ids"], strict=False)) if s != t),
            min(len(x["token_ids"]), len(y["token_ids"])),
        )
        positions += max(len(x["token_ids"]), len(y["token_ids"]))
        agreeing += n
        total += sum(abs(p - q) for p, q in zip(x["token_logprobs"][:n], y["token_logprobs"][:n], strict=True))
    return same / len(a), agreeing / positions, total / max(agreeing, 1)


def test_int8_kv_cache_against_the_float_cache(float32_rows, tmp_path):
    rows = run(tmp_path, "int8", dtype="float32", kv_cache_dtype="int8")
    same, agree, gap = _logprob_gap(rows, float32_rows)
    print(f"int8 KV vs float32 KV: {same:.0%} samples identical, {agree:.1%} positions, "
          f"mean |logprob diff| {gap:.4f}")  # fmt: skip
    # measured (AMD EPYC, AVX-512): 65% of samples identical, 82.0% of positions, mean
    # |logprob diff| 0.0211; bounds leave room for the AVX2 kernels' other rounding (unmeasured)
    assert same >= 0.4 and agree >= 0.6 and gap < 0.05, (same, agree, gap)


def test_bfloat16_against_transformers_bfloat16(tmp_path):
    from tests import optional

    if not optional.available("native_bf16"):
        pytest.skip("bf16 needs native bf16 matrix instructions (AMX or AVX512-BF16) to be fast")
    rows = run(tmp_path, "bf16", dtype="bfloat16")
    hf = hf_model(real_model.gguf(), torch.bfloat16)
    logps = teacher_forced(hf, rows)
    positions = agreeing = 0
    gap = 0.0
    for row, lp in zip(rows, logps, strict=True):
        for pos, (tok, got) in enumerate(zip(row["token_ids"], row["token_logprobs"], strict=True)):
            positions += 1
            agreeing += int(lp[pos].argmax()) == tok
            gap += abs(float(lp[pos, tok]) - float(got))
    print(f"bf16 vs transformers bf16: {agreeing / positions:.1%} of {positions} positions "
          f"agree, mean |logprob diff| {gap / positions:.4f}")  # fmt: skip
    # measured (AMD EPYC, AVX512-BF16): 97.8% of 1146 positions agree, mean |diff| 0.0286
    assert agreeing / positions >= 0.9 and gap / positions < 0.06


def test_stop_strings_spanning_several_pieces(float32_rows, tmp_path):
    """A stop string of three or more BPE pieces, taken from the middle of each greedy output,
    ends the sample just before it (the text without it, finish_reason stop)."""
    tok = tokenizer()
    picks = []
    for row in float32_rows:
        ids = list(row["token_ids"])
        if len(ids) < 12:
            continue
        piece = tok.decode(ids[6:9])
        if len(tok(piece, add_special_tokens=False)["input_ids"]) < 3 or not piece.strip():
            continue
        text = row["text"]
        if text.find(piece) == -1:
            continue
        picks.append((row["id"], piece, text[: text.find(piece)]))
        if len(picks) == 8:
            break
    assert len(picks) == 8
    table = pa.table(
        {
            "id": [i for i, _, _ in picks],
            "messages": [chat_messages()[i] for i, _, _ in picks],
            "stops": [[piece] for _, piece, _ in picks],
        }
    )
    job = write_job(
        tmp_path,
        real_model.gguf(),
        table=table,
        input_extra={"messages_column": "messages", "sampling_columns": {"stop": "stops"}},
        sampling={"temperature": 0, "max_tokens": MAX_TOKENS},
    )
    run_cli("run", str(job), "--quiet")
    got = {r["id"]: r for r in read_results(tmp_path / "out")}
    for row_id, _, before in picks:
        assert got[row_id]["text"] == before, (row_id, got[row_id]["text"], before)
        assert got[row_id]["finish_reason"] == "stop"


# multiple choice on the real model: plain prompts, continuations with their leading space
_QUESTIONS = [
    ("The capital of France is", [" Paris.", " London.", " Berlin.", " a small village."]),
    ("Water freezes at", [" 0 degrees Celsius.", " 100 degrees Celsius.", " noon."]),
    ("The largest planet in our solar system is", [" Jupiter.", " Mars.", " the Moon."]),
    ("A week has", [" seven days.", " ten days.", " three days."]),
]


def test_score_job_equals_transformers(tmp_path):
    """A score job (task: score) on the real GGUF model through the CLI: each continuation's
    summed logprob equals transformers' log-softmax over the same tokens (float32)."""
    from tests.test_score import reference_scores, rows_of, score_job

    table = pa.table(
        {
            "id": list(range(len(_QUESTIONS))),
            "prompt": [q for q, _ in _QUESTIONS],
            "choices": [c for _, c in _QUESTIONS],
        }
    )
    job = score_job(tmp_path, real_model.gguf(), table)
    run_cli("run", str(job), "--quiet")
    rows = rows_of(tmp_path / "out")
    worst = 0.0
    hf = hf_model(real_model.gguf())  # read once: dequantizing the file takes seconds
    for i, (prompt, choices) in enumerate(_QUESTIONS):
        row = rows[i]
        assert row["error"] is None
        want = reference_scores(real_model.gguf(), prompt, choices, hf)
        assert row["choice_num_tokens"] == [n for _, n in want]
        got = row["choice_logprobs"]
        worst = max(worst, *(abs(g - w) for g, (w, _) in zip(got, want, strict=True)))
        scores = row["choice_logprobs"]
        assert row["best_choice"] == max(range(len(scores)), key=lambda c: (scores[c], -c))
    assert worst < 2e-3, worst
    right = sum(rows[i]["best_choice"] == 0 for i in range(len(_QUESTIONS)))
    print(f"real model scores: largest difference {worst:.1e}, {right} of 4 best choices right")
