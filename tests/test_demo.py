"""The quick start's adder (scripts/demo_adder.py): its scoring, its tokenizer, and, slow, the
whole demo: train the model, run jobs/quickstart.yaml's settings through the CLI, count right
answers."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tests.jobkit import read_results, run_cli

ROOT = Path(__file__).resolve().parent.parent
_PATH = ROOT / "scripts" / "demo_adder.py"


@pytest.fixture(scope="module")
def adder():
    spec = importlib.util.spec_from_file_location("demo_adder_script", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_score_counts_samples_questions_and_majority(adder):
    rows = [
        {"id": 0, "text": "12", "answer": "12"},
        {"id": 0, "text": " 13 ", "answer": "12"},
        {"id": 0, "text": "13", "answer": "12"},
        {"id": 1, "text": "7", "answer": "7"},
        {"id": 1, "text": None, "answer": "7"},  # a tie: the smaller text ("") wins the vote
        {"id": 2, "text": "5", "answer": "4"},
        {"id": 2, "text": "4", "answer": "4"},  # a tie: "4" wins
    ]
    assert adder.score(rows) == {
        "samples": 7,
        "right": 3,
        "questions": 3,
        "any_right": 3,
        "majority_right": 1,
    }


def test_tokenizer_reads_one_digit_per_token(adder):
    tok = adder.byte_tokenizer()
    ids = tok(adder.question(47, 85))["input_ids"]
    assert ids[0] == adder.BOS_ID
    assert len(ids) == 1 + len("47+85=")
    answer = tok("132", add_special_tokens=False)["input_ids"]
    assert len(answer) == 3 and tok.decode(answer) == "132"


def _job(tmp_path: Path, model: Path, questions: Path, out: str, **sampling) -> Path:
    job = yaml.safe_load((ROOT / "jobs" / "quickstart.yaml").read_text())
    job["model"] = str(model)
    job["input"]["path"] = str(questions)
    job["output"]["path"] = out
    job["sampling"].update(sampling)
    path = tmp_path / f"{out}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_check_reports_the_right_count(adder, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = tmp_path / "out"
    out.mkdir()
    table = pa.table(
        {
            "id": [0, 0, 1, 1],
            "sample_index": pa.array([0, 1, 0, 1], pa.int32()),
            "text": ["3", "4", "9", "9"],
            "answer": ["3", "3", "9", "9"],
        }
    )
    pq.write_table(table, out / "part-00000.parquet")
    assert adder.check([out], examples=1) == 0
    printed = capsys.readouterr().out
    assert "3/4 answers right (75.0%, 2 per question)" in printed
    assert "right by majority vote: 2/2" in printed


@pytest.mark.slow
def test_the_demo_adds(adder, tmp_path):
    """What `make demo` promises: the trained model answers most questions right, greedy and
    sampled (measured: 98-100% greedy, 95%+ of samples; the bounds leave room for other CPUs'
    rounding during training)."""
    model = tmp_path / "adder"
    adder.train(model)  # the defaults `make demo` uses
    questions = tmp_path / "adder.parquet"
    adder.write_questions(questions, rows=100, seed=1)
    shutil.rmtree(tmp_path / "out", ignore_errors=True)

    sampled = read_results_of(_job(tmp_path, model, questions, "sampled"))
    greedy = read_results_of(_job(tmp_path, model, questions, "greedy", n=1, temperature=0.0))
    s, g = adder.score(sampled), adder.score(greedy)
    assert s["samples"] == 400 and g["samples"] == 100
    assert g["right"] >= 90, g
    assert s["right"] >= 320, s
    assert s["majority_right"] >= 90, s


def read_results_of(job: Path) -> list[dict]:
    run_cli("run", str(job), "--quiet")
    return read_results(job.parent / yaml.safe_load(job.read_text())["output"]["path"])
