"""Plain decoding rung by rung, from mlx-lm's loop to the three services, in one run.

Drafting off must cost nothing over plain mlx-lm; where it does, this says which layer adds the
time (tokens over the time from the request, prompt included; the same greedy tokens on every
rung). Every rung is set up first and then all are measured in turn, --rounds times in a
rotating order, so a host that speeds up or slows down over the run moves every rung alike:
  1. mlx-lm's generate_step on this process's main thread
  1w. the same on an MLX worker thread, as the services run it on a GPU
  2. the verifier engine's decode bursts in this process, with the verifier's GPU options
  3. a verifier service called directly over gRPC (Verify with plain_steps), no coordinator;
     with the verifier's own compute time per token
  4. the three services through the coordinator, drafting off

    python benchmarks/service_ladder.py [--target DIR] [--dtype auto] [--context 512]
        [--tokens 200] [--burst 4] [--rounds 5] [--verifier-args "--look-ahead off"]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import tempfile
import time
from pathlib import Path

import grpc
from call_overhead import as_served

from coordinator.bench import plain_decode, timing_prefills
from specd import mlx_settings
from specd.client import CoordinatorClient, make_request
from specd.launch import Stack, spawn
from specd.models.load import device_kind, load_target, resolve_dtype
from specd.service import MlxThread, channel_options
from specd.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from verifier_svc.engine import decode, prefill


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
    parser.add_argument("--rounds", type=int, default=5, help="measurements of each rung")
    parser.add_argument("--verifier-args", default="", metavar="FLAGS")
    args = parser.parse_args()
    mlx_settings.apply()  # as the services run: full float32, specd's kernel cache

    dtype = resolve_dtype(args.dtype)
    loaded = load_target(args.target, dtype)
    dtype = loaded.dtype
    prompt = [(17 * i + 3) % 1000 + 100 for i in range(args.context)]
    eos = set(loaded.identity.eos_token_ids)
    extra = timing_prefills(shlex.split(args.verifier_args))
    # the engine's own copy, as the verifier serves it: its forward wrappers stay off mlx-lm's
    target, look_ahead = as_served(args.target, dtype, extra)
    worker = MlxThread(inline_rounds=False)

    def mlx_lm():
        base = plain_decode(loaded.model, prompt, args.tokens, eos)
        return len(base.token_ids) / base.seconds, base.token_ids, ""

    def engine():
        start = time.perf_counter()
        session = prefill(target, prompt).session
        ids = [session.last_token]
        while len(ids) < args.tokens and not session.finished:
            steps = min(args.burst, args.tokens - len(ids))
            more = look_ahead and len(ids) + steps < args.tokens
            ids += decode(target, session, steps, look_ahead=more).committed
        return len(ids) / (time.perf_counter() - start), ids, ""

    logs = Path(tempfile.mkdtemp(prefix="ladder-"))
    verifier = spawn("verifier", ["--dtype", dtype, *extra] + _model(args), log_dir=logs)
    stack = Stack(
        target=args.target,
        drafter=None,
        dtype=dtype,
        verifier_args=extra,
        coordinator_args=["--decode-burst", str(args.burst)],
        log_dir=logs / "stack",
    )
    try:
        verifier.wait_healthy(900)
        stack.start()
        client = CoordinatorClient(stack.coordinator)

        def direct():
            rate, ids, compute = direct_verifier(verifier.address, prompt, args.tokens, args.burst)
            return rate, ids, f"verifier compute {1000 * compute:.2f} ms/token"

        def services():
            request = make_request(prompt_ids=prompt, max_tokens=args.tokens, num_draft_tokens=0)
            start = time.perf_counter()
            got = client.generate(request)
            return len(got.token_ids) / (time.perf_counter() - start), got.token_ids, ""

        rungs = [
            ("1. mlx-lm generate_step, main thread", mlx_lm),
            ("1w. mlx-lm generate_step, MLX worker thread",
             lambda: worker.submit(mlx_lm).result()),
            ("2. verifier engine, this process", engine),
            ("3. verifier over gRPC, no coordinator", direct),
            ("4. the three services, drafting off", services),
        ]  # fmt: skip
        rates = {name: [] for name, _ in rungs}
        ratios = {name: [] for name, _ in rungs}
        notes: dict[str, str] = {}
        reference = None
        for turn in range(args.rounds):
            this_round = {}
            for name, run in rungs[turn % len(rungs) :] + rungs[: turn % len(rungs)]:
                rate, ids, note = run()
                reference = reference or ids
                this_round[name] = rate
                rates[name].append(rate)
                notes[name] = " ".join(x for x in (_same(ids, reference), note) if x)
            for name in rates:
                ratios[name].append(this_round[name] / this_round[rungs[0][0]])
        client.close()
    finally:
        stack.stop()
        verifier.stop()
        worker.shutdown()

    print(f"device {device_kind()}, {dtype}, {args.context}-token prompt, {args.tokens} tokens, "
          f"bursts of {args.burst}, {args.rounds} rounds; logs in {logs}")  # fmt: skip
    print(f"  {'rung':<46} {'median tok/s':>12} {'range':>13}  {'vs 1, same round':>16}")
    for name, values in rates.items():
        low, high = min(values), max(values)
        print(f"  {name:<46} {statistics.median(values):12.1f} {low:6.1f}-{high:<6.1f} "
              f"{statistics.median(ratios[name]):9.2f}x      {notes[name]}")  # fmt: skip


def _model(args) -> list[str]:
    return ["--model", args.target] if args.target else []


def _same(ids: list[int], reference: list[int]) -> str:
    n = min(len(ids), len(reference))
    return "same tokens" if ids[:n] == reference[:n] else "TOKENS DIFFER"


if __name__ == "__main__":
    main()
