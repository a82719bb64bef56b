"""Plain decoding rung by rung, from mlx-lm's loop to the three services, in one run.

Drafting off must cost nothing over plain mlx-lm; where it does, this says which layer adds the
time (tokens over the time from the request, prompt included; the best of --repeats; the same
greedy tokens on every rung):
  1. mlx-lm's generate_step in this process (again after the services are up: an idle process
     holding the device beside it)
  2. the verifier engine's decode bursts in this process
  3. a verifier service called directly over gRPC (Verify with plain_steps), no coordinator; with
     the verifier's own compute time per token
  4. the three services through the coordinator, drafting off

    python benchmarks/service_ladder.py [--target DIR] [--dtype auto] [--context 512]
        [--tokens 200] [--burst 4] [--repeats 3] [--verifier-args "--look-ahead off"]
"""

from __future__ import annotations

import argparse
import shlex
import tempfile
import time
from pathlib import Path

import grpc

from coordinator.bench import plain_decode
from specd import mlx_settings
from specd.client import CoordinatorClient, make_request
from specd.launch import Stack, spawn
from specd.models.load import device_kind, load_target, resolve_dtype
from specd.service import channel_options
from specd.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from verifier_svc.engine import Target, decode, prefill


def direct_verifier(address: str, prompt: list[int], tokens: int, burst: int):
    """tok/s of OpenSession and Verify(plain_steps) calls, the ids, and the verifier's compute
    s/token after the prompt."""
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        start = time.perf_counter()
        opened = stub.OpenSession(verifier_pb2.OpenSessionRequest(prompt_ids=prompt), timeout=60)
        ids, position, compute = [opened.first_token], opened.position, 0.0
        while len(ids) < tokens:
            request = verifier_pb2.VerifyRequest(
                session_id=opened.session_id,
                position=position,
                plain_steps=min(burst, tokens - len(ids)),
            )
            answer = stub.Verify(request, timeout=60)
            ids += answer.committed_ids
            position, compute = answer.position, compute + answer.compute_s
            if answer.finished:
                break
        seconds = time.perf_counter() - start
        stub.CloseSession(common_pb2.CloseSessionRequest(session_id=opened.session_id))
    return len(ids) / seconds, ids, compute / max(len(ids) - 1, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="model (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens (made up)")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--burst", type=int, default=4, help="tokens per verifier call")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--verifier-args", default="", metavar="FLAGS")
    args = parser.parse_args()
    mlx_settings.apply()  # as the services run: full float32, specd's kernel cache

    dtype = resolve_dtype(args.dtype)
    loaded = load_target(args.target, dtype)
    dtype = loaded.dtype
    prompt = [(17 * i + 3) % 1000 + 100 for i in range(args.context)]
    eos = set(loaded.identity.eos_token_ids)
    rows: list[tuple[str, float, str]] = []

    def best(fn):
        results = [fn() for _ in range(args.repeats)]
        return max(results, key=lambda r: r[0])

    def mlx_lm():
        base = plain_decode(loaded.model, prompt, args.tokens, eos)
        return len(base.token_ids) / base.seconds, base.token_ids

    rate, reference = best(mlx_lm)
    rows.append(("1. mlx-lm generate_step, this process", rate, ""))

    target = Target(loaded, gemv_rows=0 if device_kind() == "gpu" else None)

    def engine():
        start = time.perf_counter()
        session = prefill(target, prompt).session
        ids = [session.last_token]
        while len(ids) < args.tokens and not session.finished:
            ids += decode(target, session, min(args.burst, args.tokens - len(ids))).committed
        return len(ids) / (time.perf_counter() - start), ids

    rate, ids = best(engine)
    rows.append(("2. verifier engine, this process", rate, _same(ids, reference)))

    logs = Path(tempfile.mkdtemp(prefix="ladder-"))
    extra = shlex.split(args.verifier_args)
    verifier = spawn("verifier", ["--dtype", dtype, *extra] + _model(args), log_dir=logs)
    try:
        verifier.wait_healthy(900)
        rate, ids, compute = best(
            lambda: direct_verifier(verifier.address, prompt, args.tokens, args.burst)
        )
        note = f"{_same(ids, reference)}; verifier compute {1000 * compute:.2f} ms/token"
        rows.append(("3. verifier over gRPC, no coordinator", rate, note))
    finally:
        verifier.stop()

    with Stack(
        target=args.target,
        drafter=None,
        dtype=dtype,
        verifier_args=extra,
        coordinator_args=["--decode-burst", str(args.burst)],
        log_dir=logs / "stack",
    ) as stack:
        client = CoordinatorClient(stack.coordinator)

        def services():
            request = make_request(prompt_ids=prompt, max_tokens=args.tokens, num_draft_tokens=0)
            start = time.perf_counter()
            got = client.generate(request)
            return len(got.token_ids) / (time.perf_counter() - start), got.token_ids

        rate, ids = best(services)
        rows.append(("4. the three services, drafting off", rate, _same(ids, reference)))
        rate, _ = best(mlx_lm)
        rows.append(("1'. mlx-lm again, the services idle beside it", rate, ""))
        client.close()

    first = rows[0][1]
    print(f"device {device_kind()}, {dtype}, {args.context}-token prompt, {args.tokens} tokens, "
          f"bursts of {args.burst}, best of {args.repeats}; logs in {logs}")  # fmt: skip
    for name, rate, note in rows:
        print(f"  {name:<48} {rate:8.1f} tok/s  {rate / first:5.2f}x  {note}")


def _model(args) -> list[str]:
    return ["--model", args.target] if args.target else []


def _same(ids: list[int], reference: list[int]) -> str:
    n = min(len(ids), len(reference))
    return "same tokens" if ids[:n] == reference[:n] else "TOKENS DIFFER"


if __name__ == "__main__":
    main()
