"""The verifier alone under concurrent sessions: aggregate tok/s of plain greedy decoding with
1 and N clients calling Verify(plain_steps) at once, prompts prefilled before the clock starts,
and how many sessions the verifier ran per batch (its specd_decode_batch_sessions metric).

    python benchmarks/batched_decode.py [--target DIR] [--clients 1 4 8] [--calls 12]
        [--burst 4] [--context 60] [--passes 2]
        [--verifier-args "--gemv-rows 0 --row-forwards on"]
"""

from __future__ import annotations

import argparse
import json
import shlex
import threading
import time
import urllib.request
from pathlib import Path

import grpc

from specd.launch import free_ports, spawn
from specd.service import channel_options
from specd.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc


def batches(metrics_port: int) -> tuple[float, float]:
    """(batches, sessions in them) so far."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as response:
        lines = response.read().decode().splitlines()
    total = {"count": 0.0, "sum": 0.0}
    for line in lines:
        for part in total:
            if line.startswith(f"specd_decode_batch_sessions_{part} "):
                total[part] = float(line.split()[-1])
    return total["count"], total["sum"]


def decode_calls(stub, session, calls: int, burst: int) -> int:
    position, tokens = session.position, 0
    for _ in range(calls):
        answer = stub.Verify(
            verifier_pb2.VerifyRequest(
                session_id=session.session_id, position=position, plain_steps=burst
            ),
            timeout=300,
        )
        position, tokens = answer.position, tokens + len(answer.committed_ids)
        if answer.finished:
            break
    return tokens


def level(stub, metrics_port: int, clients: int, args) -> tuple[float, float]:
    """(aggregate tok/s, sessions per batch) of `clients` sessions decoding at once."""
    sessions = [
        stub.OpenSession(
            verifier_pb2.OpenSessionRequest(
                prompt_ids=[100 + (13 * n + j) % (args.vocab - 100) for j in range(args.context)]
            ),
            timeout=300,
        )
        for n in range(clients)
    ]
    tokens = [0] * clients

    def client(n: int) -> None:
        tokens[n] = decode_calls(stub, sessions[n], args.calls, args.burst)

    count, summed = batches(metrics_port)
    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    count_after, summed_after = batches(metrics_port)
    for s in sessions:
        stub.CloseSession(common_pb2.CloseSessionRequest(session_id=s.session_id))
    return sum(tokens) / seconds, (summed_after - summed) / max(1.0, count_after - count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="model (default: the embedded SmolLM2)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--calls", type=int, default=12, help="Verify calls per client")
    parser.add_argument("--burst", type=int, default=4, help="tokens per call")
    parser.add_argument("--context", type=int, default=60, help="prompt tokens (made up)")
    parser.add_argument(
        "--passes",
        type=int,
        default=2,
        help="runs of each level, the last one timed (a GPU compiles kernels for new shapes)",
    )
    parser.add_argument(
        "--verifier-args",
        default="",
        help='more verifier flags (e.g. "--gemv-rows 0 --row-forwards on": MLX as on a GPU)',
    )
    args = parser.parse_args()
    # made-up prompts stay inside a small model's vocabulary (ids 100 to 999 at the most)
    args.vocab = 1000
    if args.target:
        config = json.loads((Path(args.target) / "config.json").read_text())
        args.vocab = min(args.vocab, config["vocab_size"])
    metrics_port, port = free_ports(2)
    flags = (
        ["--metrics-port", str(metrics_port)]
        + (["--model", args.target] if args.target else [])
        + shlex.split(args.verifier_args)
    )
    verifier = spawn("verifier", flags, port=port)
    rows = []
    try:
        verifier.wait_healthy(900)
        with grpc.insecure_channel(verifier.address, options=channel_options()) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            for clients in args.clients:
                for _ in range(args.passes):
                    measured = level(stub, metrics_port, clients, args)
                rows.append((clients, *measured))
    finally:
        verifier.stop()
    first = rows[0][1]
    print(f"plain greedy decoding, {args.calls} calls of {args.burst} tokens per client, "
          f"{args.context}-token prompts prefilled first, pass {args.passes} of each level "
          "timed")  # fmt: skip
    print(f"  {'clients':>7} {'aggregate tok/s':>16} {'vs first':>9} {'sessions per batch':>19}")
    for clients, rate, per_batch in rows:
        print(f"  {clients:7d} {rate:16.1f} {rate / first:8.2f}x {per_batch:19.2f}")


if __name__ == "__main__":
    main()
