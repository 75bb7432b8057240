"""Whole jobs through the CLI: parity with transformers, engine settings, sampling features."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pyarrow as pa
import pytest

from batchgen.model import cpu_kernels
from batchgen.tiny_model import END_OF_TURN_ID, EOS_ID, make_prompts
from tests.hf_reference import ARCHS, hf_greedy
from tests.jobkit import read_results, run_job, write_job
from tests.ties import compare_samples

BLOCK = 4


def prompts_with_lengths(tokenizer, wanted: list[int], seed: int = 0) -> list[str]:
    """Prompts whose token counts hit each wanted length (block multiples among them)."""
    by_len: dict[int, str] = {}
    rng = random.Random(seed)
    for text in make_prompts(3000, seed=seed, min_words=1, max_words=40):
        n = len(tokenizer(text)["input_ids"])
        by_len.setdefault(n, text)
        if all(w in by_len for w in wanted):
            break
    missing = [w for w in wanted if w not in by_len]
    assert not missing, f"no prompt of lengths {missing}"
    out = [by_len[w] for w in wanted]
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_matches_transformers(arch, tiny_model, tmp_path):
    from transformers import AutoTokenizer

    model = tiny_model(arch, **ARCHS[arch])
    tok = AutoTokenizer.from_pretrained(model)
    # Lengths below, at and above block boundaries, including exact multiples of the block size.
    prompts = prompts_with_lengths(tok, [2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 23, 32])
    job = write_job(
        tmp_path,
        model,
        prompts,
        sampling={"temperature": 0, "max_tokens": 24},
        engine={"block_size": BLOCK, "max_num_batched_tokens": 40, "max_num_seqs": 5},
    )
    rows = run_job(job)
    ids = [tok(p)["input_ids"] for p in prompts]
    expected = hf_greedy(model, ids, 24)
    # Exact: checked here with four prompt sets (seeds 0-3 of prompts_with_lengths) and every
    # arch; should a CPU's rounding flip a greedy near-tie, compare with tests.ties instead.
    for row, exp in zip(rows, expected, strict=True):
        assert row["token_ids"] == exp, row["id"]
        assert row["num_prompt_tokens"] == len(ids[row["id"]])
        assert row["finish_reason"] == ("stop" if exp[-1] in (EOS_ID, END_OF_TURN_ID) else "length")


def test_one_text_token_prompts_and_tight_memory_match_ample_memory(tiny_model, tmp_path):
    """Prompts of one text token (BOS + 1: the shortest a non-empty prompt can be) among longer
    ones; a pool of a few dozen blocks (preemptions) gives the same samples as an ample one, up to
    near-tie flips (tests/ties.py). Any seed must pass."""
    from transformers import AutoTokenizer

    model = tiny_model("llama", **ARCHS["llama"])
    tok = AutoTokenizer.from_pretrained(model)
    shortest = [w for w in make_prompts(200, seed=3, min_words=1, max_words=1)]
    shortest = list(dict.fromkeys(w for w in shortest if len(tok(w)["input_ids"]) == 2))[:3]
    assert len(shortest) == 3, "no one-token words in the tiny vocabulary"
    prompts = shortest + make_prompts(21, seed=3, min_words=5, max_words=30)
    common = {"temperature": 0.9, "max_tokens": 30, "n": 2, "seed": 0, "ignore_eos": True}
    ample = run_job(
        write_job(tmp_path / "a", model, prompts, sampling=common, engine={"block_size": BLOCK})
    )
    tight_job = write_job(
        tmp_path / "b",
        model,
        prompts,
        sampling=common,
        engine={"block_size": BLOCK, "kv_cache_blocks": 40, "max_num_batched_tokens": 64},
    )
    tight = run_job(tight_job)
    assert [r["num_prompt_tokens"] for r in ample[:6]] == [2] * 6
    compare_samples(tight, ample, model=model, prompts=dict(enumerate(prompts)), sampling=common)
    report = json.loads((tmp_path / "b" / "out" / ".batchgen" / "report.json").read_text())
    assert report["preemptions"] > 0
    assert report["kv_blocks"] == 40
    # fp32 on the CPU: the C kernels ran whenever they can be built here
    assert report["cpu_kernels"] is (cpu_kernels.load() is not None)


@pytest.mark.slow  # ~40 s on two busy cores: three runs, one in batches of 3
def test_sampling_is_independent_of_order_and_engine_settings(tiny_model, tmp_path):
    """Same samples (up to near-tie flips) with the rows reversed and every engine setting
    changed; any seed must pass."""
    model = tiny_model("qwen3", **ARCHS["qwen3"])
    prompts = make_prompts(16, seed=4, min_words=3, max_words=25)
    sampling = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "max_tokens": 20, "n": 3, "seed": 0}
    a = run_job(write_job(tmp_path / "a", model, prompts, sampling=sampling))
    # Reverse the row order and change every engine setting.
    table = pa.table({"id": list(range(15, -1, -1)), "prompt": prompts[::-1]})
    b = run_job(
        write_job(
            tmp_path / "b",
            model,
            table=table,
            sampling=sampling,
            engine={
                "block_size": 8,
                "max_num_seqs": 3,
                "max_num_batched_tokens": 16,
                "prefix_caching": False,
            },
        )
    )
    compare_samples(b, a, model=model, prompts=dict(enumerate(prompts)), sampling=sampling)
    # Samples of one prompt differ from each other; a different seed changes them.
    assert len({tuple(r["token_ids"]) for r in a[:3]}) > 1
    c = run_job(write_job(tmp_path / "c", model, prompts, sampling={**sampling, "seed": 1}))
    assert [r["token_ids"] for r in a] != [r["token_ids"] for r in c]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_forks_compute_the_prompt_once(tiny_model, tmp_path, monkeypatch, prefix_caching):
    """n=4 samples of a prompt share one prefill: counted by the engine (num_cached_tokens) and,
    independently, by the tokens that went through the model's forward, against the prompt
    lengths from the tokenizer. Without prefix caching the forks still share the prompt."""
    from transformers import AutoTokenizer

    from batchgen.model.families.llama import LlamaForCausalLM

    MAX_NEW = 10  # noqa: N806
    model = tiny_model("llama", **ARCHS["llama"])
    tok = AutoTokenizer.from_pretrained(model)
    prompts = make_prompts(6, seed=5, min_words=10, max_words=30)
    forwarded: list[int] = []  # tokens per forward call, in this process
    real_forward = LlamaForCausalLM.forward

    def counting_forward(self, input_ids, *args, **kwargs):
        forwarded.append(int(input_ids.shape[0]))
        return real_forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", counting_forward)
    rows = run_job(
        write_job(
            tmp_path,
            model,
            prompts,
            sampling={"temperature": 0, "n": 4, "max_tokens": MAX_NEW, "ignore_eos": True},
            engine={"block_size": BLOCK, "prefix_caching": prefix_caching},
        )
    )
    assert len(rows) == 24
    report = json.loads((tmp_path / "out" / ".batchgen" / "report.json").read_text())
    assert report["preemptions"] == 0  # no recomputation
    prompt_lengths = [len(tok(p)["input_ids"]) for p in prompts]
    assert len(set(prompts)) == 6
    # Every prompt once, then each sample's outputs but its last (never fed back).
    ideal = sum(prompt_lengths) + len(rows) * (MAX_NEW - 1)
    assert sum(forwarded) == ideal
    for i in range(6):
        group = [r for r in rows if r["id"] == i]
        assert [r["sample_index"] for r in group] == [0, 1, 2, 3]
        assert len({tuple(r["token_ids"]) for r in group}) == 1  # greedy: all the same
        assert group[0]["num_prompt_tokens"] == prompt_lengths[i]
        computed = sum(r["num_prompt_tokens"] - r["num_cached_tokens"] for r in group)
        assert computed == prompt_lengths[i]


def test_stop_strings_stop_ids_and_logprobs(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    model = tiny_model("llama", **ARCHS["llama"])
    tok = AutoTokenizer.from_pretrained(model)
    prompts = make_prompts(8, seed=6, min_words=5, max_words=20)
    base = run_job(
        write_job(
            tmp_path / "a",
            model,
            prompts,
            sampling={"temperature": 0, "max_tokens": 30, "ignore_eos": True, "logprobs": True},
        )
    )
    for r in base:
        assert len(r["token_logprobs"]) == r["num_output_tokens"]
        assert r["cumulative_logprob"] == pytest.approx(sum(r["token_logprobs"]), abs=1e-3)
        assert all(lp <= 0 for lp in r["token_logprobs"])
    # Pick a stop string from the middle of the first row's text, and a stop token from another.
    text0 = base[0]["text"]
    stop = text0[len(text0) // 2 : len(text0) // 2 + 3]
    stop_id = base[1]["token_ids"][5]
    rows = run_job(
        write_job(
            tmp_path / "b",
            model,
            prompts,
            sampling={
                "temperature": 0,
                "max_tokens": 30,
                "ignore_eos": True,
                "stop": [stop],
                "stop_token_ids": [stop_id],
            },
        )
    )
    r0 = rows[0]
    assert r0["finish_reason"] == "stop"
    assert r0["text"] == text0[: text0.find(stop)]
    assert stop not in r0["text"]
    r1 = rows[1]
    assert r1["finish_reason"] == "stop"
    first = base[1]["token_ids"].index(stop_id)
    assert r1["token_ids"] == base[1]["token_ids"][: first + 1]
    assert r1["text"] == tok.decode(base[1]["token_ids"][:first], skip_special_tokens=True)


def test_chat_messages_and_keep_columns(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    model = tiny_model("qwen2", **ARCHS["qwen2"])
    tok = AutoTokenizer.from_pretrained(model)
    msgs = [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
        [{"role": "user", "content": "tell me more"}],
    ]
    table = pa.table({"qid": ["a", "b"], "messages": msgs, "tag": [1, 2]})
    rows = run_job(
        write_job(
            tmp_path,
            model,
            table=table,
            sampling={"temperature": 0, "max_tokens": 8},
            input_extra={
                "messages_column": "messages",
                "id_column": "qid",
                "keep_columns": ["tag"],
            },
        )
    )
    assert [r["id"] for r in rows] == ["a", "b"]
    assert [r["tag"] for r in rows] == [1, 2]
    text = tok.apply_chat_template(msgs[0], tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert rows[0]["num_prompt_tokens"] == len(ids)
    assert rows[0]["token_ids"] == hf_greedy(model, [ids], 8)[0]


def test_real_subprocess_run(tiny_model, tmp_path):
    model = tiny_model("llama", **ARCHS["llama"])
    job = write_job(tmp_path, model, make_prompts(5, seed=7), sampling={"max_tokens": 5})
    proc = subprocess.run(
        [sys.executable, "-m", "batchgen.cli", "run", str(job)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "batchgen: done: 5 rows" in proc.stderr
    assert len(read_results(tmp_path / "out")) == 5
