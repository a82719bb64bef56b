"""Where a verifier call's time goes outside the verifier's own compute, on this host.

A round is one call; whatever a call costs beyond its forwards is paid every round, and on a GPU
(forwards of a few ms) it decides whether the services keep up with plain mlx-lm. Each line is
a median over --calls:
  thread hop       a job handed to another Python thread and its answer handed back
  loopback TCP     one small message to another process and back, raw sockets
  gRPC health      a health check on the verifier: gRPC both ways, no MLX
  Verify b=N       plain decoding of N tokens: the client's wall time, the verifier's compute
                   (its own clock around the forwards) and what is left: transport, the hop to
                   its MLX thread, request and answer handling

    python benchmarks/call_overhead.py [--target DIR] [--dtype auto] [--calls 60]
        [--bursts 1 4 16] [--verifier-args "--look-ahead off"]
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import shlex
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd import mlx_settings
from specd.launch import spawn
from specd.models.load import device_kind
from specd.service import channel_options
from specd.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc


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


def verify_calls(address: str, calls: int, burst: int, prompt: list[int]):
    """Medians of (client wall, verifier compute) per call of `burst` plain tokens."""
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
    return statistics.median(walls), statistics.median(computes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="model (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--bursts", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--context", type=int, default=512, help="prompt tokens (made up)")
    parser.add_argument("--verifier-args", default="", metavar="FLAGS")
    args = parser.parse_args()
    mlx_settings.apply()

    rows = [
        ("thread hop", thread_hop(args.calls), None),
        ("loopback TCP", loopback_tcp(args.calls), None),
    ]
    logs = Path(tempfile.mkdtemp(prefix="call-overhead-"))
    model = ["--model", args.target] if args.target else []
    flags = ["--dtype", args.dtype, *model, *shlex.split(args.verifier_args)]
    verifier = spawn("verifier", flags, log_dir=logs)
    prompt = [(17 * i + 3) % 200 + 50 for i in range(args.context)]  # valid in any vocabulary
    try:
        verifier.wait_healthy(900)
        rows.append(("gRPC health", health(verifier.address, args.calls), None))
        verify_calls(verifier.address, 8, 1, prompt)  # first calls of a session shape aside
        for burst in args.bursts:
            wall, compute = verify_calls(verifier.address, args.calls, burst, prompt)
            rows.append((f"Verify b={burst}", wall, compute))
    finally:
        verifier.stop()

    print(f"device {device_kind()}, verifier {' '.join(flags)}, medians of {args.calls} calls; "
          f"logs in {logs}")  # fmt: skip
    print(f"  {'call':<14} {'wall ms':>9} {'compute ms':>11} {'outside ms':>11}")
    for name, wall, compute in rows:
        if compute is None:
            print(f"  {name:<14} {1000 * wall:9.3f}")
        else:
            print(f"  {name:<14} {1000 * wall:9.3f} {1000 * compute:11.3f} "
                  f"{1000 * (wall - compute):11.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
