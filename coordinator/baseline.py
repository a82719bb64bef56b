"""Plain mlx-lm in a process of its own: the baseline `specd bench` compares the services with.

Each service is a process with its own MLX (on a GPU, its own device context); plain mlx-lm
runs here the same way, so neither side shares a process with the bench's bookkeeping, and
the bench process itself never computes on the device. The child loads the target in the
bench's dtype (`auto` is measured there, once, and every stack then uses its choice) and
answers requests over a pipe: a greedy or sampled decode with mlx-lm's `generate_step`, timed
in the child (`plain_decode`), and the logits' rounding at a position where the services'
output differs.
"""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass

from coordinator.bench import Baseline, logit_rounding, plain_decode


@dataclass(frozen=True)
class BaselineTarget:
    """What the bench needs to know of the target the child loaded."""

    name: str
    dtype: str
    dtype_timings: dict[str, float]
    eos_token_ids: tuple[int, ...]


def _serve(conn, target: str | None, dtype: str) -> None:
    from specd.models.load import load_target

    try:
        loaded = load_target(target, dtype)
    except Exception as exc:  # the parent reports it; a traceback here would say less
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    identity = loaded.identity
    conn.send(("ready", BaselineTarget(identity.name, loaded.dtype, loaded.dtype_timings,
                                       identity.eos_token_ids)))  # fmt: skip
    eos = set(identity.eos_token_ids)
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        kind, payload = request
        if kind == "close":
            return
        if kind == "decode":
            prompt_ids, max_tokens, temperature, seed = payload
            conn.send(plain_decode(loaded.model, prompt_ids, max_tokens, eos, temperature, seed))
        elif kind == "rounding":
            conn.send(logit_rounding(loaded.model, *payload))


class PlainProcessDied(RuntimeError):
    """The child running plain mlx-lm ended mid-bench (killed, or an error in MLX)."""


class BaselineProcess:
    """A child process running plain mlx-lm on the target; a context manager."""

    def __init__(self, target: str | None, dtype: str):
        context = multiprocessing.get_context("spawn")  # no MLX state inherited by fork
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child, target, dtype), name="plain-mlx-lm", daemon=True
        )
        self._process.start()
        child.close()
        try:
            kind, answer = self._conn.recv()
        except EOFError:
            self._process.join(5)
            answer, kind = f"exit code {self._process.exitcode}", "error"
        if kind == "error":
            self.close()
            raise RuntimeError(f"plain mlx-lm could not load the target: {answer}")
        self.target: BaselineTarget = answer

    def decode(
        self, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0, seed=None
    ) -> Baseline:
        """mlx-lm's generate_step in the child, timed there."""
        return self._ask("decode", (list(prompt_ids), max_tokens, temperature, seed))

    def rounding(self, prompt_ids: list[int], tokens: list[int], position: int) -> dict:
        return self._ask("rounding", (list(prompt_ids), list(tokens), position))

    def _ask(self, kind: str, payload):
        try:
            self._conn.send((kind, payload))
            return self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            code = self._process.exitcode
            raise PlainProcessDied(f"the plain mlx-lm process died (exit code {code})") from None

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
            self._process.join(10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._conn.close()

    def __enter__(self) -> BaselineProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
