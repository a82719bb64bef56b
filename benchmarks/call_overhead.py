"""Where a verifier call's time goes outside the verifier's own compute, on this host.

A round is one call; whatever a call costs beyond its forwards is paid every round, and on a GPU
(forwards of a few ms) it decides whether the services keep up with plain mlx-lm. Each line is
a median over --calls (a Verify line: means, beside the handler's mean):
  thread hop       a job handed to another Python thread and its answer handed back
  loopback TCP     one small message to another process and back, raw sockets
  gRPC health      a health check on the verifier: gRPC both ways, no MLX
  engine b=N       the verifier's decode of N tokens in this process: on this thread, handed
                   to an MLX worker thread, and awaited from an asyncio loop through that
                   worker (the verifier's path without gRPC)
  Verify b=N       plain decoding of N tokens: the client's wall time, the verifier's compute
                   (its own clock around the forwards), the verifier's handler time (from its
                   metrics) and what is left: transport, the hop to its MLX thread, request and
                   answer handling

    python benchmarks/call_overhead.py [--target DIR] [--dtype auto] [--calls 60]
        [--bursts 1 4 16] [--verifier-args "--look-ahead off"]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import queue
import re
import shlex
import socket
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd import mlx_settings
from specd.launch import free_port, spawn
from specd.models.load import device_kind
from specd.service import MlxThread, channel_options
from specd.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from verifier_svc.config import VerifierConfig
from verifier_svc.engine import Target, decode, prefill
from verifier_svc.servicer import on_gpu, target_for
from verifier_svc.warmup import warm_up


def thread_hop(calls: int) -> float:
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    answers: queue.SimpleQueue = queue.SimpleQueue()

    def worker():
        while (job := jobs.get()) is not None:
            answers.put(job)

    threading.Thread(target=worker, daemon=True).start()
    times = []
    for i in range(calls):
        start = time.perf_counter()
        jobs.put(i)
        answers.get()
        times.append(time.perf_counter() - start)
    jobs.put(None)
    return statistics.median(times)


def _echo(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := conn.recv(64):
            conn.sendall(data)


def loopback_tcp(calls: int) -> float:
    with socket.create_server(("127.0.0.1", 0)) as server:
        echo = multiprocessing.get_context("spawn").Process(
            target=_echo, args=(server.getsockname()[1],), daemon=True
        )
        echo.start()
        conn, _ = server.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            conn.sendall(b"x" * 32)
            received = 0
            while received < 32:
                received += len(conn.recv(64))
            times.append(time.perf_counter() - start)
    echo.join(5)
    return statistics.median(times)


def health(address: str, calls: int) -> float:
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def engine_calls(target: Target, calls: int, burst: int, prompt: list[int], way, ahead: bool):
    """Medians of (wall, compute) per decode of `burst` tokens, each run by `way(fn, *args)`."""
    walls, computes = [], []
    while len(walls) < calls:
        session = prefill(target, prompt).session
        for _ in range(min(calls - len(walls), 256 // burst)):
            start = time.perf_counter()
            result = way(decode, target, session, burst, ahead)
            walls.append(time.perf_counter() - start)
            computes.append(result.compute_s)
            if result.finished:
                break
        session.ahead = None
    return statistics.median(walls), statistics.median(computes)


def handler_seconds(metrics_url: str) -> tuple[float, int]:
    """The verifier's summed Verify handler time and call count so far."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    found = {}
    for kind in ("sum", "count"):
        m = re.search(rf'^specd_rpc_seconds_{kind}{{method="Verify"}} (\S+)$', text, re.M)
        found[kind] = float(m.group(1)) if m else 0.0
    return found["sum"], int(found["count"])


def as_served(target_dir: str | None, dtype: str, verifier_flags: list[str]):
    """The target a verifier started with these flags serves, and whether it leaves the next
    forward queued after a plain decode (as the verifier decides both); its prefix cache off
    unless the flags set it (benchmarks send prompts again)."""
    from coordinator.bench import timing_prefills
    from specd.cli import build_parser
    from specd.options import flag_values

    flags = build_parser().parse_args(["serve", "verifier", *timing_prefills(verifier_flags)])
    values = {**flag_values(flags, VerifierConfig), "model": target_dir, "dtype": dtype}
    config = VerifierConfig(**values)
    target = target_for(config)
    return target, on_gpu(flags.look_ahead, "look-ahead") and target.forwards_queue


def verify_calls(address: str, calls: int, burst: int, prompt: list[int]):
    """Each call's client wall time and verifier compute, over `calls` calls of `burst`
    plain tokens (a new session every 256 tokens)."""
    walls, computes = [], []
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        while len(walls) < calls:
            opened = stub.OpenSession(
                verifier_pb2.OpenSessionRequest(prompt_ids=prompt), timeout=60
            )
            position = opened.position
            for _ in range(min(calls - len(walls), 256 // burst)):
                request = verifier_pb2.VerifyRequest(
                    session_id=opened.session_id, position=position, plain_steps=burst
                )
                start = time.perf_counter()
                answer = stub.Verify(request, timeout=60)
                walls.append(time.perf_counter() - start)
                computes.append(answer.compute_s)
                position = answer.position
                if answer.finished:
                    break
            stub.CloseSession(common_pb2.CloseSessionRequest(session_id=opened.session_id))
    return walls, computes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="model (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--bursts", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--context", type=int, default=512, help="prompt tokens (made up)")
    parser.add_argument("--verifier-args", default="", metavar="FLAGS")
    parser.add_argument(
        "--max-draft-tokens",
        type=int,
        default=VerifierConfig.max_draft_tokens,
        help="as the verifier's, for its warm-up",
    )
    args = parser.parse_args()
    mlx_settings.apply()

    rows = [
        ("thread hop", thread_hop(args.calls), None, None),
        ("loopback TCP", loopback_tcp(args.calls), None, None),
    ]
    prompt = [(17 * i + 3) % 200 + 50 for i in range(args.context)]  # valid in any vocabulary
    extra = shlex.split(args.verifier_args)
    target, ahead = as_served(args.target, args.dtype, extra)
    worker = MlxThread(inline_rounds=False)
    loop = asyncio.new_event_loop()
    ways = {
        "this thread": lambda fn, *a: fn(*a),
        "MLX thread": lambda fn, *a: worker.submit(fn, *a).result(),
        "asyncio+MLX": lambda fn, *a: loop.run_until_complete(worker.run(fn, *a)),
    }
    for name, way in ways.items():
        engine_calls(target, 8, 1, prompt, way, ahead)  # first calls of a shape aside
        for burst in args.bursts:
            wall, compute = engine_calls(target, args.calls, burst, prompt, way, ahead)
            rows.append((f"engine b={burst}, {name}", wall, compute, None))
    # the verifier's own warm-up (every verify and tree size), then the worker's path again
    warmed = worker.submit(warm_up, target, args.max_draft_tokens, "full").result()
    print(f"warm-up in this process: {warmed.calls} calls in {warmed.seconds:.1f} s", flush=True)
    for burst in args.bursts:
        wall, compute = engine_calls(target, args.calls, burst, prompt, ways["MLX thread"], ahead)
        rows.append((f"engine b={burst}, MLX, warmed", wall, compute, None))

    logs = Path(tempfile.mkdtemp(prefix="call-overhead-"))
    model = ["--model", args.target] if args.target else []
    metrics_port = free_port("127.0.0.1")
    flags = ["--dtype", args.dtype, *model, *extra]
    verifier = spawn("verifier", [*flags, "--metrics-port", str(metrics_port)], log_dir=logs)
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        verifier.wait_healthy(900)
        rows.append(("gRPC health", health(verifier.address, args.calls), None, None))
        verify_calls(verifier.address, 8, 1, prompt)  # first calls of a session shape aside
        for burst in args.bursts:
            before = handler_seconds(metrics_url)
            # means, to set beside the handler's mean time from the verifier's metrics
            wall, compute = map(statistics.mean, verify_calls(verifier.address, args.calls,
                                                               burst, prompt))  # fmt: skip
            after = handler_seconds(metrics_url)
            handler = (after[0] - before[0]) / max(after[1] - before[1], 1)  # a mean, not median
            rows.append((f"Verify b={burst}", wall, compute, handler))
    finally:
        verifier.stop()
        worker.shutdown()

    print(f"device {device_kind()}, verifier {' '.join(flags)}, look-ahead in this process "
          f"{'on' if ahead else 'off'}, medians of {args.calls} calls (Verify: means); "
          f"logs in {logs}")  # fmt: skip
    print(f"  {'call':<26} {'wall ms':>9} {'compute ms':>11} {'handler ms':>11} {'outside ms':>11}")
    for name, wall, compute, handler in rows:
        if compute is None:
            print(f"  {name:<26} {1000 * wall:9.3f}")
            continue
        shown = f"{1000 * handler:11.3f}" if handler is not None else f"{'':11}"
        print(f"  {name:<26} {1000 * wall:9.3f} {1000 * compute:11.3f} {shown} "
              f"{1000 * (wall - compute):11.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
