"""The engine on token ids: parity with transformers down to length-1 prompts, block accounting
checked after every step, and the Triton backend (interpreted on a CPU) against the torch one."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen.engine.engine import Engine, EngineSettings
from batchgen.engine.noise import rng_key
from batchgen.engine.request import FinishReason, Request, SampleTarget, SamplingParams
from batchgen.model.attention import make_attention_backend
from batchgen.model.loader import load_model
from tests.hf_reference import ARCHS, hf_greedy
from tests.optional import require

CPU = torch.device("cpu")


def make_engine(model_dir, backend="torch", detokenize=None, **overrides) -> Engine:
    model, info = load_model(model_dir, CPU, torch.float32, make_attention_backend(backend))
    cfg = dict(
        block_size=4,
        num_blocks=256,
        max_num_seqs=8,
        max_num_batched_tokens=48,
        max_model_len=info.max_model_len,
        prefix_caching=True,
        attention_backend=backend,
    )
    cfg.update(overrides)
    return Engine(
        model,
        info,
        EngineSettings(**cfg),
        device=CPU,
        dtype=torch.float32,
        detokenize=detokenize,
        check_invariants=True,
    )


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    return run_requests(engine, [(p, params) for p in prompts])


def run_requests(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> dict:
    """Each (prompt, params) as the request of row i; the results by (row, sample_index)."""
    for row, (prompt, params) in enumerate(requests):
        targets = tuple(SampleTarget(row, k, rng_key(params.seed, row, k)) for k in range(params.n))
        engine.add(Request(tuple(prompt), params, targets))
    out = {}
    while engine.has_work():
        for res in engine.step():
            out[(res.target.row, res.target.sample_index)] = res
    # Nothing leaks: every block is free once the prefix cache lets go of its blocks.
    engine.scheduler.cache.evict(engine.pool.num_blocks)
    assert engine.pool.num_free == engine.pool.num_blocks
    return out


def count_fed_tokens(engine: Engine) -> list[int]:
    """Wrap the engine's model: the returned list gets the number of tokens of every forward
    pass, a count independent of the engine's own bookkeeping."""
    fed: list[int] = []
    forward = engine.model.forward

    def counting(input_ids, *args, **kwargs):
        fed.append(input_ids.numel())
        return forward(input_ids, *args, **kwargs)

    engine.model.forward = counting
    return fed


def random_prompts(lengths, vocab=512, seed=0):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(7, vocab) for _ in range(n - 1)] for n in lengths]


def test_token_prompts_from_length_one_match_transformers(tiny_model):
    model = tiny_model("llama", **ARCHS["llama"])
    prompts = random_prompts([1, 1, 2, 4, 8, 12, 13, 16, 31, 32])
    params = SamplingParams(temperature=0.0, max_tokens=16)
    out = generate(make_engine(model), prompts, params)
    expected = hf_greedy(model, prompts, 16)
    assert [out[(i, 0)].token_ids for i in range(len(prompts))] == expected


def test_prefix_sharing_rows_and_forks_match_transformers(tiny_model):
    model = tiny_model("qwen2", **ARCHS["qwen2"])
    template = random_prompts([21], seed=1)[0]
    prompts = [template + p[1:] for p in random_prompts([1, 3, 4, 5, 9], seed=2)] + [template]
    params = SamplingParams(temperature=0.0, max_tokens=12, n=3)
    engine = make_engine(model)
    fed = count_fed_tokens(engine)
    out = generate(engine, prompts, params)
    expected = hf_greedy(model, prompts, 12)
    for i, exp in enumerate(expected):
        for k in range(3):
            assert out[(i, k)].token_ids == exp
    # Prompt tokens the model computed (every output token but the last is fed back): the
    # template's 5 full blocks once, no fork computes anything, each later row at most the
    # part of its prompt after those 5 blocks (the first row's partial block may not be
    # cached yet when a row is admitted).
    decoded = sum(len(r.token_ids) - 1 for r in out.values())
    computed = sum(fed) - decoded
    assert computed <= len(template) + sum(len(p) - 20 for p in prompts[1:])
    assert engine.stats.computed_tokens == sum(fed)
    # The rows' num_cached_tokens account for exactly the prompt tokens not computed.
    assert sum(len(prompts[i]) - r.num_cached_tokens for (i, _), r in out.items()) == computed


@pytest.mark.slow  # 17-24 s each on two cores: the Triton kernels run interpreted
@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0.0, max_tokens=8, n=2),
        SamplingParams(temperature=1.0, top_k=20, max_tokens=8, n=3, seed=3),
    ],
)
def test_triton_backend_matches_torch(tiny_model, sampling):
    model = tiny_model("llama", **ARCHS["llama"])
    template = random_prompts([10], seed=4)[0]
    prompts = [template + p[1:] for p in random_prompts([1, 5, 7], seed=5)] + random_prompts([4, 9])
    want = generate(make_engine(model, "torch"), prompts, sampling)
    got = generate(make_engine(model, "triton"), prompts, sampling)
    assert {k: r.token_ids for k, r in got.items()} == {k: r.token_ids for k, r in want.items()}
    assert {k: r.num_cached_tokens for k, r in got.items()} == {
        k: r.num_cached_tokens for k, r in want.items()
    }


def test_stop_string_completed_by_the_last_allowed_token_is_a_stop(tiny_model):
    """max_tokens 24 and the text of the 24th token as the stop string: the sample ends with
    ``stop`` and its text is cut right before the stop string (not ``length`` with it kept)."""
    from transformers import AutoTokenizer

    model = tiny_model("llama", **ARCHS["llama"])
    tok = AutoTokenizer.from_pretrained(model)

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = random_prompts([5, 9, 12, 17, 20, 23], seed=6)
    outs = generate(make_engine(model), prompts, plain)
    # rows whose last token has text that occurs nowhere earlier in the output text
    cases = []
    for row, prompt in enumerate(prompts):
        ids = outs[(row, 0)].token_ids
        stop, text = decode(ids[-1:]), decode(ids)
        if stop.strip() and text.find(stop) == len(text) - len(stop):
            cases.append((prompt, stop, text[: -len(stop)]))
    assert cases, "no prompt whose last token's text is new"
    for prompt, stop, want in cases:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=(stop,))
        engine = make_engine(model, detokenize=decode)
        (res,) = generate(engine, [prompt], params).values()
        assert res.finish_reason == FinishReason.STOP
        assert res.text == want
        assert len(res.token_ids) == 24


class ScriptedModel(torch.nn.Module):
    """A stand-in model whose greedy next token is a fixed function of the current token
    (``successor``; token 0 otherwise): the engine, its scheduler and the sampler run as usual
    while the test decides the output text."""

    def __init__(self, successor: dict[int, int], vocab_size: int) -> None:
        super().__init__()
        table = torch.zeros(vocab_size, dtype=torch.int64)
        for a, b in successor.items():
            table[a] = b
        self.register_buffer("table", table)
        self.vocab_size = vocab_size

    def forward(self, input_ids, positions, kv_cache, meta, keep=None):
        # [T]: the "hidden state" of a token is the token
        return input_ids if keep is None else input_ids[keep]

    def compute_logits(self, hidden):
        return torch.nn.functional.one_hot(self.table[hidden], self.vocab_size).float()  # [S, V]


def test_stop_strings_of_multi_token_characters(tiny_model):
    """Byte-level BPE: each "é" is 2 tokens, each emoji 4, so the stop strings "ééé" and "😀😀"
    span more tokens than their length + 2; they are found, also when completed by the last
    allowed token, and not when that token leaves a character incomplete."""
    from transformers import AutoTokenizer

    model_dir = tiny_model("llama", **ARCHS["llama"])
    tok = AutoTokenizer.from_pretrained(model_dir)

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    def chain(*texts: str) -> list[int]:
        return [t for text in texts for t in ids(text)]

    e_acute, emoji = chain("é"), chain("😀")
    assert len(e_acute) == 2 and len(emoji) == 4
    x, h, i, y, o, k = chain("x", "h", "i", "y", "o", "k")
    successor = {x: h, h: i, i: e_acute[0], e_acute[0]: e_acute[1], e_acute[1]: e_acute[0]}
    successor |= {y: o, o: k, k: emoji[0], emoji[0]: emoji[1], emoji[1]: emoji[2]}
    successor |= {emoji[2]: emoji[3], emoji[3]: emoji[0]}
    # "x" -> "hiéééé..." and "y" -> "ok😀😀😀..."
    _, info = load_model(model_dir, CPU, torch.float32, make_attention_backend("torch"))
    cfg = EngineSettings(
        block_size=4, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=48, max_model_len=512
    )
    engine = Engine(
        ScriptedModel(successor, info.vocab_size),
        info,
        cfg,
        device=CPU,
        dtype=torch.float32,
        detokenize=lambda t: tok.decode(t, skip_special_tokens=True),
        check_invariants=True,
    )
    cases = {  # row: (prompt's last token, stop, max_tokens) -> (finish reason, text, tokens)
        0: ((x, "ééé", 40), ("stop", "hi", 8)),
        1: ((x, "ééé", 8), ("stop", "hi", 8)),  # completed by the last allowed token
        2: ((x, "ééé", 7), ("length", None, 7)),  # the last "é" is half there
        3: ((y, "😀😀", 40), ("stop", "ok", 10)),
        4: ((y, "😀😀", 10), ("stop", "ok", 10)),
        5: ((x, "zz", 12), ("length", None, 12)),
        6: ((x, "ié", 12), ("stop", "h", 4)),
    }
    for row, ((last, stop, max_tokens), _) in cases.items():
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=(stop,))
        engine.add(Request((1, last), params, (SampleTarget(row, 0, row),)))
    out = {}
    while engine.has_work():
        out |= {res.target.row: res for res in engine.step()}
    for row, (_, (reason, text, num_tokens)) in cases.items():
        res = out[row]
        assert (res.finish_reason.value, res.text, len(res.token_ids)) == (
            reason,
            text,
            num_tokens,
        ), row


@pytest.mark.parametrize("folded", [False, True])
def test_many_samples_of_one_prompt_respect_max_num_seqs(tiny_model, folded):
    """One prompt with n=600, or 300 identical rows with n=2 folded into one request, with
    max_num_seqs=16: no step samples more than 16 rows (counted at the model's logits), every
    sample is the greedy continuation, and the prompt is computed once plus its last token for
    each later group of 16 samples."""
    model = tiny_model("llama", **ARCHS["llama"])
    prompt = random_prompts([11], seed=7)[0]
    max_tokens, max_num_seqs = 4, 16
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine = make_engine(model, max_num_seqs=max_num_seqs)
    sampled_rows = []
    compute_logits = engine.model.compute_logits

    def counting(hidden):
        sampled_rows.append(hidden.shape[0])
        return compute_logits(hidden)

    engine.model.compute_logits = counting
    fed = count_fed_tokens(engine)
    if folded:
        targets = [SampleTarget(row, k, rng_key(0, row, k)) for row in range(300) for k in range(2)]
    else:
        targets = [SampleTarget(0, k, rng_key(0, 0, k)) for k in range(600)]
    engine.add(Request(tuple(prompt), params, tuple(targets)))
    out = []
    while engine.has_work():
        out += engine.step()
    assert sorted((r.target.row, r.target.sample_index) for r in out) == sorted(
        (t.row, t.sample_index) for t in targets
    )
    (expected,) = hf_greedy(model, [prompt], max_tokens)
    assert all(r.token_ids == expected for r in out)
    assert max(sampled_rows) == engine.scheduler.peak_num_seqs == max_num_seqs
    assert sum(sampled_rows) == 600 * max_tokens
    decoded = 600 * (max_tokens - 1)  # every output token but the last is fed back
    assert sum(fed) - decoded == len(prompt) + 600 // max_num_seqs  # the model's own count
    assert engine.stats.computed_tokens == sum(fed)


def test_engine_gives_the_sampler_the_c_kernels_on_a_cpu(tiny_model, monkeypatch):
    """On a CPU the sampler gets the C noise and race; where they cannot be built, the PyTorch
    formula."""
    from batchgen.engine.noise import TORCH_FORMULA
    from batchgen.model import cpu_kernels

    require("cpu_kernels")
    model = tiny_model("llama", **ARCHS["llama"])
    native = cpu_kernels.load()
    kernels = make_engine(model).sampler_kernels
    assert kernels.race_draw == native.race_draw
    assert kernels.uniform_noise == native.uniform_noise
    monkeypatch.setattr(cpu_kernels, "load", lambda *args: None)  # as without a C compiler
    assert make_engine(model).sampler_kernels == TORCH_FORMULA
