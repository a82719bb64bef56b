import asyncio
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2

from specd.launch import free_port, free_ports, health_status, spawn
from specd.service import (
    CannotBind,
    FailedPrecondition,
    MlxThread,
    ResourceExhausted,
    Server,
    SessionTable,
)
from specd.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc


def test_session_table_limits_and_unknown_ids():
    table = SessionTable(limit=2, idle_timeout_s=60)
    a = table.add("A")
    table.add("B")
    with pytest.raises(ResourceExhausted) as full:
        table.add("C")
    assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit is 2" in str(full.value)
    assert table.pop(a) == "A"
    with pytest.raises(FailedPrecondition):
        table.get(a)
    table.add("C")
    assert len(table) == 2


def test_idle_sessions_expire_and_used_ones_stay(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("specd.service.time.monotonic", lambda: now[0])
    table = SessionTable(limit=10, idle_timeout_s=30)
    idle, used = table.add("idle"), table.add("used")
    now[0] += 20
    table.get(used)
    now[0] += 20
    assert table.expire() == 1
    assert table.get(used) == "used"
    with pytest.raises(FailedPrecondition) as gone:
        table.get(idle)
    assert "expired" in str(gone.value)


def test_a_port_in_use_is_refused_not_shared():
    """gRPC's default SO_REUSEPORT let a second service share a busy port, and calls went to
    whichever answered (a Stack once gave its verifier and drafter the same port)."""

    async def hold_and_try_again():
        held = Server("127.0.0.1", 0, [])
        with pytest.raises(CannotBind, match="in use"):
            Server("127.0.0.1", held.port, [])
        run = subprocess.run(
            [sys.executable, "-m", "specd", "serve", "drafter", "--port", str(held.port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 1
        assert f"specd: drafter: cannot listen on 127.0.0.1:{held.port}" in run.stderr

    asyncio.run(hold_and_try_again())
    ports = free_ports(8)
    assert len(set(ports)) == 8


def test_the_grpc_port_is_bound_before_metrics_are_served():
    """A metrics port the OS picks (0) was once the drafter's own gRPC port, handed out by
    `free_ports` and not yet bound: metrics now start only once the gRPC port is held, so the
    one port asked for twice is refused as a metrics port, with a reason."""
    port = free_port()
    run = subprocess.run(
        [sys.executable, "-m", "specd", "serve", "drafter", "--port", str(port),
         "--metrics-port", str(port)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert f"specd: drafter: cannot serve metrics on 127.0.0.1:{port}: Address already in use" in (
        run.stderr
    )


EXIT_AFTER_MLX_WORK = """
import asyncio
import mlx.core as mx
from mlx_lm.models.activations import swiglu  # an mx.compile'd function, as models use
from specd.service import MlxThread

def job():
    x = mx.ones((4, 8))
    mx.eval(swiglu(x, x))

async def main():
    threads = [MlxThread() for _ in range(16)]
    await asyncio.gather(*(t.run(job) for t in threads))
    for t in threads:
        t.shutdown()

asyncio.run(main())
"""


def test_a_process_exits_cleanly_after_mlx_work_on_its_threads():
    """An exiting MLX thread destroys its compile cache under the GIL; racing the interpreter's
    finalization, that aborted services at exit (status 134) in about 4 of 10 runs of this
    script before the thread stayed parked."""
    for _ in range(6):
        done = subprocess.run(
            [sys.executable, "-c", EXIT_AFTER_MLX_WORK], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr


def test_mlx_thread_cancels_queued_jobs_at_shutdown_and_refuses_new_ones():

    async def main():
        worker = MlxThread()
        release = threading.Event()
        running = asyncio.ensure_future(worker.run(release.wait, 5))
        queued = asyncio.ensure_future(worker.run(lambda: "never"))
        await asyncio.sleep(0.05)
        threading.Timer(0.1, release.set).start()
        worker.shutdown()  # waits for the running job
        assert await running is True
        with pytest.raises(asyncio.CancelledError):
            await queued
        with pytest.raises(RuntimeError, match="shut down"):
            await worker.run(lambda: None)
        assert await MlxThread().run(divmod, 7, 2) == (3, 1)

    asyncio.run(main())


def test_a_round_job_runs_inline_only_when_the_mlx_worker_is_idle():

    ran: list[tuple[str, str]] = []

    async def main():
        mlx = MlxThread()
        started, release = threading.Event(), threading.Event()

        def long_job():
            started.set()
            release.wait(10)
            ran.append(("long", threading.current_thread().name))

        def round_job():
            ran.append(("round", threading.current_thread().name))

        waiting = asyncio.ensure_future(mlx.run(long_job))
        cancelled_while_queued = asyncio.ensure_future(mlx.run(round_job))
        while not started.is_set():
            await asyncio.sleep(0.001)
        waiting.cancel()  # its caller gives up; the job itself runs on
        cancelled_while_queued.cancel()  # never runs, yet the worker is still busy
        queued = asyncio.ensure_future(mlx.run_round(round_job))
        await asyncio.sleep(0.05)
        assert ran == []  # not beside the running job
        release.set()
        await queued
        await mlx.run_round(round_job)  # the worker is idle: on the loop's own thread
        mlx.shutdown()

    asyncio.run(main())
    main_thread = threading.current_thread().name
    assert [what for what, _ in ran] == ["long", "round", "round"]
    assert ran[1][1] != main_thread and ran[2][1] == main_thread


def test_a_stopping_service_refuses_new_calls_and_exits_once_its_streams_end(tmp_path):
    """SIGTERM: the service keeps serving while it drains, refusing new calls and an open
    stream's next message with a status a client acts on, and stops once nothing is left in
    flight. (Stopping gRPC at once had a call that arrived as the stop began sit without a
    handler until the grace period ended, cancelled with "Cancelling all calls".)"""
    port, metrics_port = free_ports(2)
    drafter = spawn("drafter", ["--metrics-port", str(metrics_port)], port=port, log_dir=tmp_path)
    try:
        drafter.wait_healthy(120)
        with grpc.insecure_channel(drafter.address) as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            session = stub.OpenSession(drafter_pb2.DraftOpenRequest(context_ids=[5, 6, 7, 5, 6]))
            requests = queue.Queue()
            stream = stub.DraftStream(iter(requests.get, None))
            requests.put(drafter_pb2.DraftRequest(session_id=session.session_id, position=5))
            assert list(next(stream).draft_ids) == [7, 5, 6]  # the stream is open and answered
            drafter.process.send_signal(signal.SIGTERM)
            while health_status(drafter.address) == health_pb2.HealthCheckResponse.SERVING:
                time.sleep(0.01)
            # draining: the open stream holds the stop; a new call is refused, not left hanging
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetInfo(common_pb2.InfoRequest(), timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in refused.value.details()
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=30) as scrape:
                counted = scrape.read().decode()
            assert 'specd_rpc_total{code="UNAVAILABLE",method="GetInfo"} 1.0' in counted
            requests.put(drafter_pb2.DraftRequest(session_id=session.session_id, position=5))
            with pytest.raises(grpc.RpcError) as ended:
                next(stream)
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in ended.value.details()
            requests.put(None)
        assert drafter.process.wait(30) == 0, drafter.log_tail()
        assert "still running" not in drafter.log_path.read_text()  # drained, not timed out
    finally:
        drafter.stop()


def test_without_inline_rounds_every_job_runs_on_the_worker():
    async def main():
        mlx = MlxThread(inline_rounds=False)
        names = [await mlx.run_round(lambda: threading.current_thread().name) for _ in range(3)]
        mlx.shutdown()
        return names

    assert set(asyncio.run(main())) == {"mlx"}


def test_the_mlx_worker_keeps_nothing_of_a_finished_job_while_it_waits_for_the_next():
    """A job's arguments and result are not held by the idle worker: a closed session's caches
    (and a KV pool's slot through them) go once their callers let go, not at the next job."""
    import gc
    import weakref

    from specd.service import Batch

    class Held:
        pass

    mlx = MlxThread(inline_rounds=False)
    batch = Batch(lambda items: [Held() for _ in items])
    for submit in (lambda arg: mlx.submit(lambda held: Held(), arg),
                   lambda arg: mlx.submit_batched(batch, arg)):  # fmt: skip
        argument = Held()
        future = submit(argument)
        gone = [weakref.ref(argument), weakref.ref(future.result(5))]
        del argument, future
        for _ in range(500):  # the worker settles the future, then goes back to its queue
            gc.collect()
            if all(ref() is None for ref in gone):
                break
            time.sleep(0.01)
        assert [ref() for ref in gone] == [None, None]
    mlx.shutdown()


def test_sampling_and_tree_checks_every_service_shares():
    from specd.service import InvalidArgument, check_sampling_params, check_tree_request
    from specd.v1 import common_pb2

    check_sampling_params(common_pb2.SamplingParams(temperature=0.7, top_p=0.9, top_k=5))
    for bad, named in (
        (common_pb2.SamplingParams(temperature=float("nan")), "temperature"),
        (common_pb2.SamplingParams(temperature=-1), "temperature"),
        (common_pb2.SamplingParams(top_p=1.5), "top_p"),
        (common_pb2.SamplingParams(top_p=float("nan")), "top_p"),
        (common_pb2.SamplingParams(min_p=-0.1), "min_p"),
        (common_pb2.SamplingParams(min_p=float("inf")), "min_p"),
        (common_pb2.SamplingParams(top_k=-2), "top_k"),
    ):
        with pytest.raises(InvalidArgument, match=f"^{named} must"):
            check_sampling_params(bad)
    tree = common_pb2.TreeShape
    check_tree_request(tree(total_tokens=8, depth=4, top_k=2), "eagle3", True, 16)
    check_tree_request(tree(total_tokens=0), "ngram", False, 0)  # a chain
    for shape, trees, limit, reason in (
        (tree(total_tokens=-1), True, 16, ">= 0"),
        (tree(total_tokens=8), False, 16, "chains only"),
        (tree(total_tokens=32, depth=4, top_k=2), True, 16, "exceeds"),
    ):
        with pytest.raises(InvalidArgument, match=reason):
            check_tree_request(shape, "x", trees, limit)


def test_batched_jobs_queued_together_run_in_one_call_and_others_keep_their_order():
    from specd.service import Batch

    calls, order = [], []

    def run_many(items):
        calls.append(list(items))
        return [ValueError(f"bad {x}") if x < 0 else 10 * x for x in items]

    batch = Batch(run_many)
    mlx = MlxThread(inline_rounds=False)
    gate = threading.Event()
    blocker = mlx.submit(gate.wait)  # holds the worker while the others queue up
    first = mlx.submit_batched(batch, 1)
    plain = mlx.submit(lambda: order.append("plain") or "plain")
    second, bad = mlx.submit_batched(batch, 2), mlx.submit_batched(batch, -1)
    gate.set()
    assert blocker.result(5) is True
    assert first.result(5) == 10 and second.result(5) == 20 and plain.result(5) == "plain"
    with pytest.raises(ValueError, match="bad -1"):
        bad.result(5)
    assert calls == [[1, 2, -1]]  # one call for the three, the plain job after it
    alone = mlx.submit_batched(batch, 3)
    assert alone.result(5) == 30 and calls[-1] == [3]
    assert mlx._finished == mlx._submitted  # idle again: inline rounds would run
    mlx.shutdown()


def test_a_batch_never_waits_for_a_caller_whose_key_is_none():
    """Batch.key None: a caller that does not come back (a prompt) is not recorded, so later
    jobs never wait for it; other callers seen lately are waited for until recent_s passes."""
    from specd.service import Batch

    batch = Batch(lambda items: items, key=lambda item: None if item < 0 else item)
    batch.ran([-1, 5], now=100.0)
    assert set(batch.seen) == {5}
    assert not batch.missing([5], now=100.1)  # the prompt is not waited for
    assert batch.missing([6], now=100.1)  # caller 5 may come back
    assert not batch.missing([6], now=100.1 + batch.recent_s)


def test_a_lone_callers_batched_job_runs_inline_while_the_worker_is_idle():
    """run_batched(inline=True): a caller alone in its batch, the worker idle, runs on the event
    loop's thread; with another caller of the batch seen lately it queues for the worker, to be
    batched; so does a job not marked inline, and every job of a thread without inline rounds."""
    from specd.service import Batch

    threads: list[tuple[str, list]] = []

    def run_many(items):
        threads.append((threading.current_thread().name, list(items)))
        return [ValueError(f"bad {x}") if x < 0 else 10 * x for x in items]

    def key(item):
        return abs(item) // 100  # the caller: 1xx and 2xx are two sessions

    async def main():
        mlx, batch = MlxThread(), Batch(run_many, key=key)
        assert await mlx.run_batched(batch, 101, inline=True) == 1010
        with pytest.raises(ValueError, match="bad -102"):  # its error raised as the worker's
            await mlx.run_batched(batch, -102, inline=True)
        assert await mlx.run_batched(batch, 103) == 1030  # not marked inline
        assert await mlx.run_batched(batch, 201, inline=True) == 2010  # caller 1 seen lately
        assert await mlx.run_batched(batch, 104, inline=True) == 1040  # and caller 2
        mlx.shutdown()
        other = MlxThread(inline_rounds=False)
        assert await other.run_batched(Batch(run_many), 5, inline=True) == 50
        other.shutdown()

    asyncio.run(main())
    loop_thread = threading.current_thread().name
    assert [(name == loop_thread, items) for name, items in threads] == [
        (True, [101]), (True, [-102]), (False, [103]), (False, [201]), (False, [104]),
        (False, [5]),
    ]  # fmt: skip


def test_a_stream_batch_answers_each_item_when_done_and_takes_later_ones_until_others_wait():
    from specd.service import Batch

    mlx = MlxThread(inline_rounds=False)
    seen: list[list] = []
    arrived = threading.Event()

    def run_stream(items, more, answer):
        seen.append(list(items))
        if len(seen) > 1:  # a later call: answer its items
            for item in items:
                answer(item, item * 10)
            return
        answer(items[0], items[0] * 10)  # the caller wakes while the stream still runs
        assert arrived.wait(5)  # it queues another item of the batch, and a plain job
        taken = []
        while not taken:
            taken = more()
        seen.append(list(taken))
        assert more() == []  # a plain job waits: no more items join
        for item in [*items[1:], *taken]:
            answer(item, ValueError("bad") if item < 0 else item * 10)

    batch = Batch(lambda items: [], run_stream=run_stream)
    first, second = mlx.submit_batched(batch, 1), mlx.submit_batched(batch, -1)
    assert first.result(5) == 10
    third = mlx.submit_batched(batch, 3)
    plain = mlx.submit(lambda: "plain")
    fourth = mlx.submit_batched(batch, 4)  # behind the plain job: the next call's
    arrived.set()
    assert third.result(5) == 30 and plain.result(5) == "plain" and fourth.result(5) == 40
    with pytest.raises(ValueError, match="bad"):
        second.result(5)
    assert seen == [[1, -1], [3], [4]] or seen == [[1], [-1, 3], [4]]
    assert mlx._finished == mlx._submitted
    mlx.shutdown()


def test_a_stream_batch_answers_each_item_when_done_and_runs_other_jobs_between_its_steps():
    """With held_job_steps, a plain job (a prompt's prefill) queued while a stream runs runs
    between two of its steps once it has waited that many, and items queued behind it still
    join the stream: it does not drain first (the verifier's --prefill-between-steps)."""
    from specd.service import Batch

    steps = 4

    mlx = MlxThread(inline_rounds=False)
    seen: list[list] = []
    arrived = threading.Event()
    more_calls_until_plain_ran: list[int] = []
    submitted: dict = {}

    def run_stream(items, more, answer):
        seen.append(list(items))
        answer(items[0], items[0] * 10)  # the caller wakes while the stream still runs
        assert arrived.wait(5)  # another item of the batch, a plain job, one more item
        taken = []
        while not taken:
            taken = more()
        seen.append(list(taken))
        calls = 1
        while not submitted["plain"].done():
            assert more() == [] and calls <= steps
            calls += 1
        more_calls_until_plain_ran.append(calls)
        for item in [*items[1:], *taken]:
            answer(item, ValueError("bad") if item < 0 else item * 10)

    batch = Batch(lambda items: [], run_stream=run_stream, held_job_steps=steps)
    first, second = mlx.submit_batched(batch, 1), mlx.submit_batched(batch, -1)
    assert first.result(5) == 10
    third = mlx.submit_batched(batch, 3)
    submitted["plain"] = mlx.submit(lambda: "plain")
    fourth = mlx.submit_batched(batch, 4)  # behind the plain job, and still in this stream
    arrived.set()
    assert third.result(5) == 30 and fourth.result(5) == 40
    assert submitted["plain"].result(5) == "plain"
    with pytest.raises(ValueError, match="bad"):
        second.result(5)
    assert seen == [[1, -1], [3, 4]] or seen == [[1], [-1, 3, 4]]
    assert more_calls_until_plain_ran == [steps + 1]  # it ran within the stream
    assert mlx._finished == mlx._submitted
    mlx.shutdown()


def test_shutdown_waits_for_a_stream_that_runs_other_jobs_between_its_steps():
    """Shutting down, the thread's last job runs after the stream, not between its steps:
    no MLX work may go on once shutdown returns."""
    from specd.service import Batch

    mlx = MlxThread(inline_rounds=False)
    started, finished = threading.Event(), threading.Event()

    def run_stream(items, more, answer):
        started.set()
        for _ in range(50):
            more()
            time.sleep(0.002)
        finished.set()
        for item in items:
            answer(item, item)

    stream = mlx.submit_batched(Batch(lambda items: [], run_stream=run_stream,
                                      held_job_steps=0), 1)  # fmt: skip
    assert started.wait(5)
    mlx.shutdown()
    assert finished.is_set()
    assert stream.result(5) == 1


def test_jobs_of_a_batch_held_behind_another_batch_run_in_one_call_when_it_is_done():
    from specd.service import Batch

    prefill_calls, round_calls = [], []
    prefills = Batch(lambda items: prefill_calls.append(list(items)) or list(items))

    def run_stream(items, more, answer):
        round_calls.append(list(items))
        for item in items:
            answer(item, item)

    rounds = Batch(lambda items: [], run_stream=run_stream)
    mlx = MlxThread(inline_rounds=False)
    gate = threading.Event()
    mlx.submit(gate.wait)
    prefill = mlx.submit_batched(prefills, "p")
    # the prefill's call takes these from the queue and holds them while it runs
    waiting = [mlx.submit_batched(rounds, i) for i in range(3)]
    plain = mlx.submit(lambda: "plain")
    waiting += [mlx.submit_batched(rounds, i) for i in range(3, 6)]
    gate.set()
    assert prefill.result(5) == "p" and plain.result(5) == "plain"
    assert [f.result(5) for f in waiting] == list(range(6))
    assert prefill_calls == [["p"]]
    assert round_calls == [list(range(6))]  # one stream for all six, not one each
    assert mlx._finished == mlx._submitted
    mlx.shutdown()


def test_a_batch_waits_briefly_for_its_recent_callers_and_never_for_strangers():
    from specd.service import Batch

    calls = []
    batch = Batch(lambda items: calls.append(list(items)) or list(items), key=lambda x: x[0],
                  gather_s=0.5, recent_s=60.0)  # fmt: skip
    mlx = MlxThread(inline_rounds=False)
    assert mlx.submit_batched(batch, ("a", 1)).result(5) == ("a", 1)  # alone: no wait
    gate = threading.Event()
    mlx.submit(gate.wait)
    first = [mlx.submit_batched(batch, ("a", 2)), mlx.submit_batched(batch, ("b", 2))]
    gate.set()
    assert [f.result(5) for f in first] == [("a", 2), ("b", 2)]
    # "a" comes back first; "b", seen in the last call, a moment later: one call for both
    late = threading.Timer(0.05, lambda: answers.append(mlx.submit_batched(batch, ("b", 3))))
    answers = [mlx.submit_batched(batch, ("a", 3))]
    late.start()
    late.join()
    assert [f.result(5) for f in answers] == [("a", 3), ("b", 3)]
    assert calls[-1] == [("a", 3), ("b", 3)]
    # a caller that does not come back costs at most gather_s
    start = time.perf_counter()
    assert mlx.submit_batched(batch, ("a", 4)).result(5) == ("a", 4)
    assert time.perf_counter() - start < 2
    # one said to be gone is not waited for
    batch.gather_s = 30.0
    batch.forget("b")
    start = time.perf_counter()
    assert mlx.submit_batched(batch, ("a", 5)).result(5) == ("a", 5)
    assert time.perf_counter() - start < 2
    mlx.shutdown()
