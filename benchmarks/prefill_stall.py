"""How long a session already decoding waits while another client's long prompt is prefilled.

One verifier service; session A decodes one token per Verify call, back to back; after a few
calls a second client opens session B with a long prompt (input-grounded first turns, repeated
to `--prompt-tokens`). Reported per verifier setting: B's prefill (its OpenSession call), A's
longest call while it ran, and how many tokens A got in that time. With `--prefill-slice-tokens`
at its default the prompt runs a decoder layer per job and A's rounds run between them; with 0
A waits for the whole prompt. Each setting starts its own verifier, `--rounds` times in turn.

    python benchmarks/prefill_stall.py [--target DIR] [--prompt-tokens 1000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc

from specd.datasets import load_questions
from specd.launch import spawn
from specd.models.load import load_tokenizer
from specd.prompts import encode_chat
from specd.service import channel_options
from specd.v1 import verifier_pb2, verifier_pb2_grpc


def long_prompt(tokenizer, tokens: int) -> list[int]:
    ids: list[int] = []
    for question in load_questions("input-grounded"):
        ids += encode_chat(tokenizer, [{"role": "user", "content": question.turns[0]}])
        if len(ids) >= tokens:
            return ids[:tokens]
    return ids


def measure(address: str, prompt: list[int]) -> dict:
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        opened = stub.OpenSession(verifier_pb2.OpenSessionRequest(prompt_ids=[1, 2, 3]))
        position, calls = opened.position, []  # (start, end) of each of A's calls
        window = {}

        def open_long():
            window["start"] = time.perf_counter()
            stub.OpenSession(verifier_pb2.OpenSessionRequest(prompt_ids=prompt), timeout=600)
            window["end"] = time.perf_counter()

        other = threading.Thread(target=open_long)
        while "end" not in window:
            if len(calls) == 5:
                other.start()
            start = time.perf_counter()
            answer = stub.Verify(
                verifier_pb2.VerifyRequest(
                    session_id=opened.session_id, position=position, plain_steps=1
                ),
                timeout=600,
            )
            calls.append((start, time.perf_counter()))
            position = answer.position
        other.join()
    during = [e - s for s, e in calls if e > window["start"] and s < window["end"]]
    return {
        "prefill_s": window["end"] - window["start"],
        "longest_wait_s": max(during),
        "tokens_during": len(during),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", help="model (default: the embedded SmolLM2)")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--settings", default="256,0", help="--prefill-slice-tokens values to compare")
    args = p.parse_args()
    prompt = long_prompt(load_tokenizer(args.target), args.prompt_tokens)
    settings = [s.strip() for s in args.settings.split(",")]
    results = {s: [] for s in settings}
    logs = Path(tempfile.mkdtemp(prefix="prefill-stall-"))
    model = ["--model", args.target] if args.target else []
    for r in range(args.rounds):
        for setting in settings if r % 2 == 0 else settings[::-1]:
            verifier = spawn(
                "verifier", [*model, "--prefill-slice-tokens", setting], log_dir=logs / setting
            )
            try:
                verifier.wait_healthy(600)
                results[setting].append(measure(verifier.address, prompt))
            finally:
                verifier.stop()
    print(f"prompt of {len(prompt)} tokens; median of {args.rounds} rounds")
    head = f"{'--prefill-slice-tokens':>22}{'prefill s':>11}{'A longest wait s':>18}"
    print(head + f"{'A tokens':>10}")
    for setting, rows in results.items():
        prefill = statistics.median(r["prefill_s"] for r in rows)
        wait = statistics.median(r["longest_wait_s"] for r in rows)
        tokens = statistics.median(r["tokens_during"] for r in rows)
        print(f"{setting:>22}{prefill:>11.2f}{wait:>18.3f}{tokens:>10.0f}")


if __name__ == "__main__":
    main()
