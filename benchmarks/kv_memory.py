"""The verifier's memory with many sessions open, and after they close, cycle after cycle.

Each cycle opens --sessions sessions (a --prompt-tokens prompt each), decodes --tokens plain
tokens in every one, reads the verifier's metrics (its sessions' KV cache bytes, MLX's active,
cached and peak memory, the process's resident memory), closes them all and reads them again.
Memory that grows from cycle to cycle after the sessions close is a leak. The readings after
a close are taken once MLX's active memory stops changing (the verifier handles closes on its
own time); the prefix cache's bytes (prompts' KV it keeps, in host memory) are a column of
their own.

    python benchmarks/kv_memory.py [--target DIR] [--sessions 64] [--prompt-tokens 256]
        [--tokens 16] [--cycles 3] [--verifier-args "..."]
"""

from __future__ import annotations

import argparse
import shlex
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from specd.launch import free_port, spawn
from specd.service import channel_options
from specd.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

READINGS = {
    "KV caches": "specd_kv_cache_bytes",
    "prefix cache": "specd_prefix_cache_bytes",
    "MLX active": 'specd_mlx_memory_bytes{kind="active"}',
    "MLX cache": 'specd_mlx_memory_bytes{kind="cache"}',
    "MLX peak": 'specd_mlx_memory_bytes{kind="peak"}',
    "resident": "process_resident_memory_bytes",
}


def read_metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    values = {}
    for name, prefix in READINGS.items():
        for line in text.splitlines():
            if line.startswith(prefix + " ") or line.startswith(prefix + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


def settled_metrics(url: str, longest_s: float = 60.0) -> dict[str, float]:
    """The metrics once MLX's active memory stops changing: a closed session's KV goes when
    the verifier has handled its close (with the prefix cache on, after a job on its MLX
    thread copies what it keeps), not when CloseSession returns."""
    values = read_metrics(url)
    deadline = time.monotonic() + longest_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        again = read_metrics(url)
        if again.get("MLX active") == values.get("MLX active"):
            return again
        values = again
    return values


def session_round(stub, prompt: list[int], tokens: int) -> str:
    opened = stub.OpenSession(verifier_pb2.OpenSessionRequest(prompt_ids=prompt), timeout=600)
    position = opened.position
    while position - len(prompt) < tokens:
        answer = stub.Verify(
            verifier_pb2.VerifyRequest(
                session_id=opened.session_id, position=position,
                plain_steps=min(16, tokens - (position - len(prompt))),
            ),
            timeout=600,
        )  # fmt: skip
        position = answer.position
        if answer.finished:
            break
    return opened.session_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="model (default: the embedded SmolLM2)")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=16, help="plain tokens decoded per session")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--verifier-args", default="", metavar="FLAGS")
    args = parser.parse_args()

    metrics_port = free_port()
    flags = [*(["--model", args.target] if args.target else []), "--metrics-port",
             str(metrics_port), "--max-sessions", str(args.sessions),
             *shlex.split(args.verifier_args)]  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="kv-memory-"))
    verifier = spawn("verifier", flags, log_dir=logs)
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    rows = []
    try:
        verifier.wait_healthy(900)
        rows.append(("started", 0, read_metrics(url)))
        with grpc.insecure_channel(verifier.address, options=channel_options()) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            prompts = [[(31 * s + 7 * i) % 200 + 50 for i in range(args.prompt_tokens)]
                       for s in range(args.sessions)]  # fmt: skip
            for cycle in range(1, args.cycles + 1):
                with ThreadPoolExecutor(args.sessions) as pool:
                    ids = list(pool.map(lambda p: session_round(stub, p, args.tokens), prompts))
                rows.append((f"cycle {cycle}, open", len(ids), read_metrics(url)))
                for session_id in ids:
                    stub.CloseSession(common_pb2.CloseSessionRequest(session_id=session_id))
                rows.append((f"cycle {cycle}, closed", 0, settled_metrics(url)))
    finally:
        verifier.stop()

    print(f"{args.sessions} sessions of {args.prompt_tokens} prompt tokens and {args.tokens} "
          f"decoded, {args.cycles} cycles; MiB; logs in {logs}")  # fmt: skip
    print(f"  {'when':<18} {'sessions':>8} " + " ".join(f"{n:>11}" for n in READINGS)
          + f" {'KV/session':>11}")  # fmt: skip
    for when, sessions, values in rows:
        cells = " ".join(f"{values.get(n, float('nan')) / 2**20:11.1f}" for n in READINGS)
        per = values.get("KV caches", 0) / sessions / 2**20 if sessions else float("nan")
        print(f"  {when:<18} {sessions:>8} {cells} {per:11.2f}")


if __name__ == "__main__":
    main()
