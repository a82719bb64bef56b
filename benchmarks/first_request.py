"""Where the first request after SERVING loses its time: a verifier started as the services
start it, then the same greedy request several times (and another prompt between), each split
into its prefill and its decode bursts (the coordinator's schedule: 4 tokens, then as many as
produced so far, up to the burst), wall time against the verifier's own compute per call.

    python benchmarks/first_request.py [--target DIR] [--max-tokens 128] [--burst 16]
        [--verifier-args "--warmup separate"]
"""

from __future__ import annotations

import argparse
import shlex
import time

import grpc

from specd.launch import free_ports, spawn
from specd.service import channel_options
from specd.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

FIRST_BURST = 4  # as coordinator/rounds.py starts a request


def run_request(stub, prompt: list[int], max_tokens: int, burst: int) -> dict:
    start = time.perf_counter()
    opened = stub.OpenSession(verifier_pb2.OpenSessionRequest(prompt_ids=prompt), timeout=900)
    prefill_s = time.perf_counter() - start
    produced, position, calls = 1, opened.position, []
    while produced < max_tokens:
        steps = min(burst, max(FIRST_BURST, produced), max_tokens - produced)
        began = time.perf_counter()
        answer = stub.Verify(
            verifier_pb2.VerifyRequest(
                session_id=opened.session_id, position=position, plain_steps=steps
            ),
            timeout=900,
        )
        wall = time.perf_counter() - began
        calls.append((len(answer.committed_ids), wall, answer.compute_s))
        produced += len(answer.committed_ids)
        position = answer.position
        if answer.finished:
            break
    stub.CloseSession(common_pb2.CloseSessionRequest(session_id=opened.session_id))
    return {"prefill_s": prefill_s, "calls": calls, "tokens": produced}


def summary(name: str, run: dict) -> str:
    calls = run["calls"]
    tokens = sum(n for n, _, _ in calls)
    wall = sum(w for _, w, _ in calls)
    compute = sum(c for _, _, c in calls)
    first = calls[0] if calls else (0, 0.0, 0.0)
    slowest = max(calls, key=lambda c: c[1] / max(1, c[0])) if calls else (0, 0.0, 0.0)
    decode = 1e3 * wall / max(1, tokens)
    return (
        f"{name:<14} prefill {1e3 * run['prefill_s']:8.1f} ms  decode {decode:6.2f}"
        f" ms/token (compute {1e3 * compute / max(1, tokens):6.2f})  first burst"
        f" {1e3 * first[1] / max(1, first[0]):6.2f} ms/token  slowest burst"
        f" {1e3 * slowest[1] / max(1, slowest[0]):6.2f} ms/token ({slowest[0]} tokens)"
        f"  total {1e3 * (run['prefill_s'] + wall):8.1f} ms for {run['tokens']} tokens"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="model (default: the embedded SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--burst", type=int, default=16, help="the coordinator's decode burst")
    parser.add_argument("--verifier-args", default="", help="more verifier flags")
    args = parser.parse_args()
    (port,) = free_ports(1)
    flags = (["--model", args.target] if args.target else []) + shlex.split(args.verifier_args)
    started = time.perf_counter()
    verifier = spawn("verifier", flags, port=port)
    prompt_a = [100 + (13 * j) % 900 for j in range(44)]
    prompt_b = [200 + (7 * j) % 800 for j in range(90)]
    try:
        verifier.wait_healthy(900)
        print(f"verifier SERVING {time.perf_counter() - started:.1f} s after its start")
        with grpc.insecure_channel(verifier.address, options=channel_options()) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            plan = [("A, first", prompt_a), ("A, again", prompt_a), ("B, first", prompt_b),
                    ("A, third", prompt_a), ("B, again", prompt_b)]  # fmt: skip
            runs = []
            for name, prompt in plan:
                run = run_request(stub, prompt, args.max_tokens, args.burst)
                runs.append(run)
                print(summary(name, run), flush=True)
    finally:
        verifier.stop()

    def per_token(run: dict) -> float:
        return (run["prefill_s"] + sum(w for _, w, _ in run["calls"])) / max(1, run["tokens"])

    print(f"first request / later (A): {per_token(runs[0]) / per_token(runs[3]):.2f}; "
          f"B first / again: {per_token(runs[2]) / per_token(runs[4]):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
