"""The step loop both drafter trainers share: epoch order, progress line, checkpoints."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from drafter_svc.checkpoints import write_whole
from specd.progress import Progress

RECENT = 50  # steps the progress line and the summary average over
CURVE_FILE = "held_out_curve.json"  # beside the checkpoint: a resumed run keeps the whole curve


class HeldOutCurve(list):
    """Held-out figures at each checkpoint ({"step": ..., ...} points), kept in the checkpoint
    directory as they come, so that training.json after a resume holds the curve from the
    run's first step, not only from the resume."""

    def __init__(self, checkpoint: Path, resumed_at: int | None):
        """resumed_at: the step the run goes on from (None: it starts over)."""
        super().__init__()
        self.path = checkpoint / CURVE_FILE
        if resumed_at is not None and self.path.is_file():
            kept = json.loads(self.path.read_text())
            self.extend(p for p in kept if p["step"] <= resumed_at)

    def add(self, point: dict) -> None:
        self.append(point)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self)
        write_whole(self.path, lambda f: f.write_text(text))

    def at(self, step: int) -> bool:
        return bool(self) and self[-1]["step"] == step


def resume(trainer, checkpoint: Path, wanted: bool) -> HeldOutCurve:
    """Go on from the checkpoint where wanted and there is one (saying so); the held-out curve
    as it stood at the step the run goes on from."""
    resumed = wanted and trainer.load_checkpoint(checkpoint)
    if resumed:
        print(f"resumed from {checkpoint} at step {trainer.step}", file=sys.stderr)
    return HeldOutCurve(checkpoint, trainer.step if resumed else None)


def write_summary(out: Path, summary: dict, held: list, curve: HeldOutCurve) -> dict:
    """training.json (written whole): the run's summary, with the held-out curve where there
    was a held-out set."""
    if held:
        summary["held_out_conversations"] = len(held)
        summary["held_out_curve"] = curve
    text = json.dumps(summary, indent=2) + "\n"
    write_whole(out / "training.json", lambda path: path.write_text(text))
    return summary


def epoch_order(count: int, epochs: float, seed: int) -> np.ndarray:
    """Example indices for every step: one permutation per epoch, the same after a resume."""
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.permutation(count) for _ in range(math.ceil(epochs) + 1)])


def run_steps(trainer, step: Callable[[int], object], checkpoint: Path, save_every: int,
              describe: Callable[[list], str],
              at_checkpoint: Callable[[], None] | None = None,
              deadline: float | None = None) -> tuple[list, float]:  # fmt: skip
    """Call step(trainer.step) until trainer.total_steps, checkpointing every save_every steps
    (and then calling at_checkpoint, e.g. a held-out evaluation, and at the end). step returns
    a record (or None when it had nothing to learn from); describe turns the recent records
    into the progress line's figures. deadline (a time.perf_counter() value): take no step
    after it; the checkpoint is saved as at the end, so a later run resumes there.
    Returns (recent records, seconds)."""
    started, first = time.perf_counter(), trainer.step
    recent: list = []
    progress = Progress()
    while trainer.step < trainer.total_steps:
        if deadline is not None and time.perf_counter() >= deadline:
            break
        record = step(trainer.step)
        if record is not None:
            recent = (recent + [record])[-RECENT:]
        done = trainer.step - first
        rate = done / max(1e-9, time.perf_counter() - started)
        eta = (trainer.total_steps - trainer.step) / rate if rate > 0 else 0
        filled = int(24 * trainer.step / trainer.total_steps)
        progress.update(
            f"[{'#' * filled}{'.' * (24 - filled)}] {trainer.step}/{trainer.total_steps} "
            f"{describe(recent)} {rate:.2f} it/s eta {eta / 60:.0f} min",
            final=trainer.step == trainer.total_steps,
        )
        if trainer.step % save_every == 0:
            trainer.save_checkpoint(checkpoint)
            if at_checkpoint is not None and trainer.step < trainer.total_steps:
                at_checkpoint()
    progress.close()
    if trainer.step < trainer.total_steps:
        print(f"--time-limit reached at step {trainer.step} of {trainer.total_steps}; the same "
              "command again goes on from there", file=sys.stderr)  # fmt: skip
    trainer.save_checkpoint(checkpoint)
    if at_checkpoint is not None:
        at_checkpoint()
    return recent, time.perf_counter() - started
