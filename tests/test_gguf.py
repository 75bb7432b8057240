"""GGUF files as ``model:`` (batchgen/model/gguf.py), on tiny random models written as GGUF
(tests/gguf_files.py): every supported tensor type, llama's permuted Q/K rows, qwen2's biases,
qwen3's QK norms, tied and untied embeddings; greedy parity with transformers reading the same
file; the refusals; the fingerprint; validate's line."""

from __future__ import annotations

import shutil

import pytest
import torch

from batchgen.model.gguf import SUPPORTED_TYPES
from tests.gguf_files import write_gguf
from tests.hf_reference import hf_greedy, hf_model
from tests.jobkit import invoke, refusal, run_cli, run_job, write_job

# Every supported type on one of the tiny model's matrices (K-quants need rows of 256).
ALL_TYPES = {
    "blk.0.attn_q.weight": "Q4_K",
    "blk.0.attn_k.weight": "Q5_K",
    "blk.0.attn_v.weight": "Q6_K",
    "blk.0.attn_output.weight": "Q2_K",
    "blk.0.ffn_gate.weight": "Q3_K",
    "blk.0.ffn_up.weight": "Q4_0",
    "blk.0.ffn_down.weight": "Q4_1",
    "blk.1.attn_q.weight": "Q5_0",
    "blk.1.attn_k.weight": "Q5_1",
    "blk.1.attn_v.weight": "F16",
    "blk.1.attn_output.weight": "BF16",
    "blk.1.ffn_gate.weight": "F32",
    "output.weight": "Q8_0",
}
WIDE = dict(hidden_size=256, intermediate_size=512, num_heads=4, head_dim=64)
ARCHS = {
    "llama": dict(WIDE, num_kv_heads=2),
    "qwen2": dict(WIDE, num_kv_heads=1, tie_word_embeddings=True),
    # transformers' GGUF reader leaves a qwen3 head_dim at its config default (128; batchgen
    # reads attention.key_length), so the reference needs a model whose head_dim is 128
    "qwen3": dict(WIDE, num_heads=2, num_kv_heads=1, head_dim=128),
}


def test_the_tests_cover_every_supported_type():
    assert set(ALL_TYPES.values()) == set(SUPPORTED_TYPES)


@pytest.fixture(scope="module")
def gguf_model(tiny_model, tmp_path_factory):
    """``gguf_model(arch) -> (folder, .gguf)``: the tiny model and its GGUF, every type in it."""
    made = {}

    def make(arch: str):
        if arch not in made:
            folder = tiny_model(arch, **ARCHS[arch])
            out = tmp_path_factory.mktemp(f"gguf-{arch}") / f"{arch}.gguf"
            types = {k: v for k, v in ALL_TYPES.items() if arch != "qwen2" or k != "output.weight"}
            made[arch] = folder, write_gguf(folder, out, types, default="Q8_0")
        return made[arch]

    return make


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_weights_equal_transformers_gguf_reader(arch, gguf_model):
    """Each tensor, dequantized and (llama) unpermuted, equals what transformers' own GGUF
    reader makes of it: every supported type, every name mapped."""
    from batchgen.model.gguf import GgufModel

    _, path = gguf_model(arch)
    hf = hf_model(path).state_dict()
    ours = GgufModel.open(path)
    names = [n for n in hf if not n.endswith("rotary_emb.inv_freq")]
    checked = 0
    for name in names:
        if ours.shape(name) is None:
            assert name == "lm_head.weight" and arch == "qwen2"  # tied: no output.weight
            continue
        got = ours.load(name, torch.float32, torch.device("cpu"))
        assert torch.equal(got, hf[name]), name
        checked += 1
    assert checked >= 20


def test_float32_gguf_equals_the_original_checkpoint(tiny_model, tmp_path):
    """Independent of transformers' GGUF reader: an all-F32 GGUF of a llama (Q/K rows permuted
    by the writer as llama.cpp does) loads back to the original safetensors weights exactly."""
    from safetensors.torch import load_file

    from batchgen.model.gguf import GgufModel

    folder = tiny_model("llama", **ARCHS["llama"])
    path = write_gguf(folder, tmp_path / "f32.gguf")
    original = load_file(str(folder / "model.safetensors"))
    ours = GgufModel.open(path)
    for name, want in original.items():
        assert torch.equal(ours.load(name, torch.float32, torch.device("cpu")), want), name


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_matches_transformers_on_the_same_file(arch, gguf_model, tmp_path):
    from batchgen.model.loader import load_tokenizer
    from batchgen.tiny_model import make_prompts

    _, path = gguf_model(arch)
    tok = load_tokenizer(path)
    prompts = make_prompts(6, seed=3, min_words=3, max_words=30)
    job = write_job(
        tmp_path,
        path,
        prompts,
        sampling={"temperature": 0, "max_tokens": 12},
        engine={"block_size": 4, "max_num_batched_tokens": 48},
    )
    rows = run_job(job)
    ids = [tok(p)["input_ids"] for p in prompts]
    assert all(i[0] == tok.bos_token_id for i in ids)  # add_bos_token from the metadata
    expected = hf_greedy(path, ids, 12)
    for row, want in zip(rows, expected, strict=True):
        assert row["token_ids"] == want, row["id"]
        assert row["num_prompt_tokens"] == len(ids[row["id"]])


def test_chat_template_and_eos_come_from_the_metadata(gguf_model, tmp_path):
    from batchgen.model.loader import load_tokenizer
    from batchgen.model.registry import read_model_info
    from batchgen.tiny_model import CHAT_TEMPLATE, EOS_ID

    _, path = gguf_model("llama")
    assert read_model_info(path).eos_token_ids == (EOS_ID,)
    tok = load_tokenizer(path)
    assert tok.chat_template == CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<s><|user|>\nhi<|end|>\n"


def test_validate_prints_types_and_dequantized_size(gguf_model, tmp_path):
    _, path = gguf_model("llama")
    job = write_job(tmp_path, path, ["a b c"])
    out = run_cli("validate", str(job)).output
    line = next(x for x in out.splitlines() if x.startswith("weights:"))
    from gguf import GGUFReader

    elements = sum(int(t.n_elements) for t in GGUFReader(str(path)).tensors)
    assert line.startswith("weights:  GGUF F32 x6, Q8_0 x4, ") and "Q4_K x1" in line, line
    assert f"-> {elements * 4 / 1e6:.0f} MB in float32 (dequantized at load)" in line, line
    bf16 = run_cli("validate", str(job), "--set", "engine.dtype=bfloat16").output
    assert f"-> {elements * 2 / 1e6:.0f} MB in bfloat16" in bf16, bf16


def test_fingerprint_covers_the_file(gguf_model, tmp_path):
    from batchgen.model.loader import model_identity

    _, path = gguf_model("llama")
    copy = tmp_path / "copy.gguf"
    shutil.copy(path, copy)
    assert model_identity(copy) == model_identity(path)
    data = bytearray(copy.read_bytes())
    data[-100] ^= 0xFF  # one weight byte of the last tensor
    changed = tmp_path / "changed.gguf"
    changed.write_bytes(bytes(data))
    assert model_identity(changed) != model_identity(path)

    job = write_job(tmp_path / "job", copy, ["a b c"], sampling={"max_tokens": 2})
    run_cli("run", str(job), "--quiet")
    shutil.copy(changed, copy)
    line = refusal(invoke("run", str(job), "--quiet"))
    assert "different job" in line and "model" in line


def test_unsupported_type_architecture_and_damage_exit_2_with_one_line(tiny_model, tmp_path):
    folder = tiny_model("llama", **ARCHS["llama"])

    def refused(path, *needles):
        job = write_job(tmp_path / path.stem, path, ["a b c"])
        line = refusal(invoke("run", str(job), "--quiet"))
        for needle in needles:
            assert needle in line, (needle, line)

    gemma = write_gguf(folder, tmp_path / "gemma.gguf", arch="gemma")
    refused(gemma, "unsupported GGUF architecture 'gemma'", "llama, qwen2, qwen3")

    iq = write_gguf(folder, tmp_path / "iq.gguf", {"blk.0.ffn_up.weight": "IQ4_NL"})
    refused(iq, "unsupported GGUF tensor type IQ4_NL", "blk.0.ffn_up.weight", "Q4_K")

    whole = write_gguf(folder, tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) // 2])
    refused(cut, "GGUF file", str(cut))

    missing = tmp_path / "missing.gguf"
    refused(missing, "model file not found", str(missing))
