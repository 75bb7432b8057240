"""output.reasoning: the split of <think> ... </think> from the answer, on a tokenizer that has
the tags, and input.chat_template_kwargs reaching the chat template."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
from transformers import AutoTokenizer

from batchgen.reasoning import ReasoningSplit
from batchgen.tiny_model import train_tokenizer
from tests.jobkit import copy_model, run_cli, write_job

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if think %}<think>{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def thinking_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with <think> and </think> added to its tokenizer (inside its vocab), and
    a chat template that opens the thinking when ``think`` is passed."""
    model = copy_model(tiny_model(), tmp_path_factory.mktemp("thinking"))
    tok = train_tokenizer(500)  # room in the model's 512 rows for the two tags
    tok.add_tokens(["<think>", "</think>"])
    assert len(tok) <= 512
    tok.chat_template = TEMPLATE
    tok.save_pretrained(model)
    return model


def test_split_on_the_tags(thinking_model):
    tok = AutoTokenizer.from_pretrained(thinking_model)
    split = ReasoningSplit.of("auto", tok, lambda ids: tok.decode(ids, skip_special_tokens=True))
    assert split is not None and ReasoningSplit.of("off", tok, str) is None
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert split.split(enc("q"), enc("<think>a plan</think>the answer"), None) == (
        "the answer",
        "a plan",
    )
    # the prompt opened the thinking; the sample closes it
    assert split.split(enc("q<think>"), enc("a plan</think>yes"), None) == ("yes", "a plan")
    # it ends inside its thinking: no text, the unfinished thinking
    assert split.split(enc("q<think>"), enc("still going"), None) == ("", "still going")
    assert split.split(enc("q"), enc("<think>still"), None) == ("", "still")
    # no thinking at all: the text as it is, no reasoning
    assert split.split(enc("q"), enc("just text"), None) == ("just text", None)
    # a stop string cut the text: split the text
    assert split.split(enc("q"), enc("x"), "<think>p</think>ans") == ("ans", "p")


def test_no_split_without_the_tags(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model())
    assert ReasoningSplit.of("auto", tok, str) is None


def test_reasoning_column_and_chat_template_kwargs(tmp_path, thinking_model):
    tok = AutoTokenizer.from_pretrained(thinking_model)
    messages = [[{"role": "user", "content": "hello"}]]
    table = pa.table({"id": [0], "messages": messages})
    sampling = {"temperature": 0, "max_tokens": 3, "ignore_eos": True}
    job = write_job(tmp_path, thinking_model, table=table, sampling=sampling,
                    input_extra={"messages_column": "messages",
                                 "chat_template_kwargs": {"think": True}})  # fmt: skip
    run_cli("run", job, "--quiet")
    (row,) = ds.dataset(tmp_path / "out", format="parquet").to_table().to_pylist()
    end = tok.convert_tokens_to_ids("</think>")
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    if end in row["token_ids"]:  # a random model may close its thinking
        cut = row["token_ids"].index(end)
        assert row["reasoning"] == decode(row["token_ids"][:cut]).strip("\n")
    else:  # the template opened the thinking: the sample ended inside it
        assert row["text"] == "" and row["reasoning"] == decode(row["token_ids"]).strip("\n")
    # without the kwarg the template opens no thinking: the text is the output
    run_cli("run", job, "--quiet", "--fresh", "--set", "input.chat_template_kwargs={}",
            "--set", "output.reasoning=off")  # fmt: skip
    (row,) = ds.dataset(tmp_path / "out", format="parquet").to_table().to_pylist()
    assert "reasoning" not in row and row["text"] == decode(row["token_ids"])
