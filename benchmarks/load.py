"""Concurrent requests through one coordinator: throughput, errors, and whether every output
equals the same request run alone.

    python benchmarks/load.py --coordinator 127.0.0.1:50050 --concurrency 16 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from specd.client import CoordinatorClient, make_request

PROMPTS = [
    "Explain how a bicycle works.",
    "Write a short poem about the sea.",
    "List three uses of copper.",
    "What is the capital of France? Answer in one sentence, then repeat it.",
]


def run_load(address: str, concurrency: int, max_tokens: int) -> dict:
    requests = [
        make_request(
            messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], max_tokens=max_tokens
        )
        for i in range(concurrency)
    ]
    client = CoordinatorClient(address)
    solo = {}
    for prompt_index in range(min(concurrency, len(PROMPTS))):
        solo[prompt_index] = client.generate(requests[prompt_index]).token_ids

    def one(i: int):
        try:
            return client.generate(requests[i]).token_ids, None
        except grpc.RpcError as err:
            return None, f"{err.code().name}: {err.details()}"

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(concurrency)))
    seconds = time.perf_counter() - start
    client.close()
    errors = [e for _, e in results if e]
    tokens = sum(len(ids) for ids, _ in results if ids)
    identical = sum(ids == solo[i % len(PROMPTS)] for i, (ids, _) in enumerate(results))
    return {
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "errors": errors,
        "identical_to_solo": identical,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coordinator", default="127.0.0.1:50050")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    print(json.dumps(run_load(args.coordinator, args.concurrency, args.max_tokens), indent=1))


if __name__ == "__main__":
    main()
