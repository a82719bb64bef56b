"""The verifier's periodic load line (--log-stats): what it counts, and that a serving
verifier writes it after calls and not while idle."""

import asyncio
import logging
import re

from specd.service import MlxThread
from specd.v1 import verifier_pb2
from tests.sessions import RpcContext
from verifier_svc.config import VerifierConfig
from verifier_svc.load_log import LoadStats
from verifier_svc.servicer import VerifierServicer


def test_an_interval_counts_calls_tokens_and_sessions_per_forward_then_resets():
    now = [100.0]
    stats = LoadStats(clock=lambda: now[0])
    for sessions in (16, 16, 4):
        stats.stepped(sessions)
    stats.answered(4)
    stats.answered(12)
    now[0] = 102.0
    interval = stats.take()
    assert (interval.seconds, interval.calls, interval.tokens) == (2.0, 2, 16)
    assert (interval.forwards, interval.sessions, interval.widest) == (3, 36, 16)
    assert interval.line(open_sessions=5, kv_bytes=3 * 2**20) == (
        "last 2.0 s: 2 verify calls, 16 tokens committed (8.0 tok/s), round forwards 3 (12.0 "
        "sessions each, widest 16); 5 sessions open, KV 3.0 MiB"
    )
    now[0] = 103.0
    empty = stats.take()
    assert "held" not in empty.line(0, 0) and "away" not in empty.line(0, 0)
    assert (empty.seconds, empty.calls, empty.forwards, empty.widest) == (1.0, 0, 0, 0)
    assert "round forwards" not in empty.line(0, 0)  # no forward to describe


def test_an_interval_says_how_long_calls_were_held_and_sessions_away_between_them():
    now = [10.0]
    stats = LoadStats(clock=lambda: now[0])
    first = stats.arrived(None)  # a session's first call: nothing to be away from
    now[0] = 10.030
    a_answered = stats.answered(3, first, computing=0.020)  # held 30 ms, 20 in forwards
    now[0] = 10.080
    second = stats.arrived(a_answered)  # back 50 ms after its answer
    other = stats.arrived(None)
    now[0] = 10.090
    a_answered = stats.answered(1, second, computing=0.004)  # held 10 ms, 6 waiting
    stats.answered(1, other, computing=0.010)
    now[0] = 10.400
    stats.arrived(a_answered)  # 310 ms away
    interval = stats.take()
    assert (interval.returns, interval.timed) == (2, 3)
    assert interval.line(2, 0).endswith(
        "; a call held 16.7 ms (5.3 waiting), away 180.0 ms between calls (longest 310); "
        "2 sessions open, KV 0.0 MiB"
    )


def test_an_interval_says_how_long_prefills_held_the_mlx_thread():
    now = [0.0]
    stats = LoadStats(clock=lambda: now[0])
    stats.prefilled(3, 0.020)  # three prompts prefilled together
    stats.prefilled(0, 0.005)  # a layer of a long prompt
    stats.prefilled(1, 0.006)  # its last
    now[0] = 1.0
    interval = stats.take()
    assert interval.line(4, 0).endswith(
        "; prefills 4 in 3 jobs, 31 ms; 4 sessions open, KV 0.0 MiB"
    )
    assert "prefills" not in stats.take().line(0, 0)


def test_a_serving_verifier_logs_its_load_after_calls_and_not_while_idle(tiny_model_dir, caplog):
    log = logging.getLogger("specd.verifier.test")

    async def main():
        mlx = MlxThread()
        config = VerifierConfig(model=str(tiny_model_dir), warmup="minimal", log_stats_s=0.05)
        verifier = VerifierServicer(config, mlx)
        await verifier.load()
        reporter = asyncio.create_task(verifier.log_load_forever(log))
        context = RpcContext()
        await asyncio.sleep(0.15)  # idle: no line
        idle_lines = len(caplog.records)
        opened = [
            await verifier.OpenSession(verifier_pb2.OpenSessionRequest(prompt_ids=p), context)
            for p in ([5, 6, 7], [8, 9, 10, 11])
        ]

        async def decode(o):
            return await verifier.Verify(
                verifier_pb2.VerifyRequest(session_id=o.session_id, position=o.position,
                                           plain_steps=3),
                context,
            )  # fmt: skip

        answers = await asyncio.gather(*(decode(o) for o in opened))
        await asyncio.sleep(0.12)
        reporter.cancel()
        mlx.shutdown()
        return idle_lines, sum(len(a.committed_ids) for a in answers)

    with caplog.at_level(logging.INFO, logger="specd.verifier.test"):
        idle_lines, committed = asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "specd.verifier.test"]
    assert idle_lines == 0
    # an interval may end between a forward and its answer: add up the lines
    counted = [re.search(r"(\d+) verify calls, (\d+) tokens committed", line) for line in lines]
    assert lines  # how many depends on when the intervals end: the totals are checked
    assert sum(int(m[1]) for m in counted) == 2
    assert sum(int(m[2]) for m in counted) == committed
    assert all(
        "2 sessions open" in line for line, m in zip(lines, counted, strict=True) if int(m[1])
    )
    prefilled = [re.search(r"prefills (\d+) in (\d+) jobs", line) for line in lines]
    assert sum(int(m[1]) for m in prefilled if m) == 2  # the two prompts opened
    # the rounds ran through the shared-forward stream, which counted its forwards
    forwards = [re.search(r"round forwards (\d+) \(([\d.]+) sessions each", x) for x in lines]
    assert sum(int(m[1]) for m in forwards if m) >= 1
    assert all(1.0 <= float(m[2]) <= 2.0 for m in forwards if m)
    assert any(re.search(r"a call held [\d.]+ ms \([\d.]+ waiting\)", x) for x in lines)
