"""The quick start's reviews (scripts/demo_reviews.py): its data, its scoring, and, slow, the
whole demo on a few reviews: the real model labels them through the CLI with
jobs/quickstart.yaml's settings, and most labels are right."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests import real_model
from tests.jobkit import read_results, run_cli

ROOT = Path(__file__).resolve().parent.parent
_PATH = ROOT / "scripts" / "demo_reviews.py"


@pytest.fixture(scope="module")
def reviews():
    spec = importlib.util.spec_from_file_location("demo_reviews_script", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_data_is_deterministic_balanced_and_varied(reviews):
    rows = reviews.make_rows(200, seed=0)
    assert rows == reviews.make_rows(200, seed=0)
    assert rows != reviews.make_rows(200, seed=1)
    assert [r["id"] for r in rows] == list(range(200))
    assert Counter(r["label"] for r in rows) == {"positive": 100, "negative": 100}
    assert set(r["product"] for r in rows) == set(reviews.PRODUCTS)
    assert len({r["review"] for r in rows}) >= 150  # few repeats
    # the labels are not spelled out: no review holds the word of its label
    assert not any(r["label"] in r["review"].lower() for r in rows)
    row = rows[0]
    assert row["messages"] == [
        {"role": "system", "content": reviews.SYSTEM},
        {"role": "user", "content": row["review"]},
    ]


def test_data_files(reviews, tmp_path):
    reviews.write_data(tmp_path, rows=20, seed=0, summarize=6)
    table = pq.read_table(tmp_path / "reviews.parquet")
    assert table.num_rows == 20
    assert table.schema.field("messages").type == pa.list_(
        pa.struct([("role", pa.string()), ("content", pa.string())])
    )
    firsts = pq.read_table(tmp_path / "summarize.parquet").to_pylist()
    assert [r["id"] for r in firsts] == list(range(6))
    assert firsts[0]["review"] == table.column("review")[0].as_py()
    assert "Summarize" in firsts[0]["messages"][-1]["content"]


def test_score_counts_samples_reviews_and_majority(reviews):
    rows = [
        {"id": 0, "text": "positive", "label": "positive"},
        {"id": 0, "text": " negative ", "label": "positive"},
        {"id": 0, "text": "negative", "label": "positive"},
        {"id": 1, "text": "negative", "label": "negative"},
        {"id": 1, "text": None, "label": "negative"},  # a tie: the smaller text ("") wins the vote
        {"id": 2, "text": "positive", "label": "negative"},
        {"id": 2, "text": "negative", "label": "negative"},  # a tie: "negative" wins
    ]
    assert reviews.score(rows) == {
        "samples": 7,
        "right": 3,
        "reviews": 3,
        "majority_right": 1,
    }


def test_check_prints_accuracies_and_examples(reviews, tmp_path, capsys):
    reviews.write_data(tmp_path, rows=2, seed=0, summarize=2)
    labels = pq.read_table(tmp_path / "reviews.parquet").column("label").to_pylist()
    wrong = {"positive": "negative", "negative": "positive"}
    sampled, greedy, summaries = tmp_path / "sampled", tmp_path / "greedy", tmp_path / "summaries"
    for folder in (sampled, greedy, summaries):
        folder.mkdir()
    table = pa.table(
        {
            "id": [0, 0, 1, 1],
            "sample_index": pa.array([0, 1, 0, 1], pa.int32()),
            "text": [labels[0], wrong[labels[0]], labels[1], labels[1]],
            "label": [labels[0], labels[0], labels[1], labels[1]],
        }
    )
    pq.write_table(table, sampled / "part-00000.parquet")
    pq.write_table(table.filter(pa.array([True, False, True, False])), greedy / "part-0.parquet")
    said = pa.table({"id": [0], "sample_index": pa.array([0], pa.int32()), "text": ["Good."]})
    pq.write_table(said, summaries / "part-00000.parquet")

    assert reviews.check([sampled, greedy], summaries, tmp_path / "reviews.parquet", 2) == 0
    printed = capsys.readouterr().out
    assert f"{sampled}: 3/4 labels right (75.0%, 2 per review)" in printed
    assert "right by majority vote of the 2: 1/2 (50.0%)" in printed  # the tie goes to "negative"
    assert f"{greedy}: 2/2 labels right (100.0%, 1 per review)" in printed
    assert "summary: 'Good.'" in printed


def test_check_refuses_a_folder_without_labels(reviews, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    table = pa.table({"id": [0], "sample_index": pa.array([0], pa.int32()), "text": ["positive"]})
    pq.write_table(table, out / "part-00000.parquet")
    assert reviews.check([out], None, None, 1) == 2
    assert "no `label` column" in capsys.readouterr().out


@pytest.mark.slow
def test_the_demo_labels_reviews(reviews, tmp_path):
    """What `make demo` promises, on its first 32 reviews: the real model labels most of them
    right, greedy and sampled (two samples each here)."""
    reviews.write_data(tmp_path, rows=32, seed=0, summarize=0)
    job = yaml.safe_load((ROOT / "jobs" / "quickstart.yaml").read_text())
    job["model"] = str(real_model.gguf())
    job["input"]["path"] = str(tmp_path / "reviews.parquet")
    job["output"]["path"] = "sampled"
    job["sampling"]["n"] = 2
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    run_cli("run", str(path), "--quiet")
    run_cli(
        "run", str(path), "--quiet",
        "--set", "output.path=greedy", "--set", "sampling.n=1", "--set", "sampling.temperature=0",
    )  # fmt: skip
    s = reviews.score(read_results(tmp_path / "sampled"))
    g = reviews.score(read_results(tmp_path / "greedy"))
    assert s["samples"] == 64 and g["samples"] == 32
    assert g["right"] >= GREEDY_MIN, g
    assert s["right"] >= SAMPLED_MIN, s


# Of 32 and 64; chance is 16 and 32. Measured (AMD EPYC, AVX512-BF16): 26 and 52 in bf16, 25 and
# 51 in float32 (what `auto` gives on a CPU without native bf16).
GREEDY_MIN, SAMPLED_MIN = 20, 40
