"""Synchronous rounds vs drafting during the verify (--overlap-drafting), with a delay on the
coordinator-drafter link (benchmarks/delay_proxy.py), same prompts, side by side.

    python benchmarks/latency_hiding.py --questions mt-bench --every 8 --delays 1,5
    python benchmarks/latency_hiding.py --drafter eagle3 --num-draft-tokens 1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specd.client import CoordinatorClient, make_request
from specd.datasets import load_questions
from specd.launch import free_port, spawn
from specd.models.load import load_target
from specd.prompts import encode_chat

HERE = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", default="mt-bench")
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--delays", default="1,5", help="one-way delays in ms")
    parser.add_argument("--target")
    parser.add_argument("--drafter", default="ngram", choices=["ngram", "eagle3"],
                        help="a drafter that drafts past speculative ids")  # fmt: skip
    parser.add_argument("--num-draft-tokens", type=int, default=0,
                        help="k pinned per request; 0: adaptive")  # fmt: skip
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="specd-latency-"))
    tokenizer = load_target(args.target, "auto").tokenizer
    prompts = [
        encode_chat(tokenizer, [{"role": "user", "content": q.turns[0]}])
        for q in load_questions(args.questions)[:: args.every]
    ]
    target_args = ["--model", args.target] if args.target else []
    verifier = spawn("verifier", target_args, log_dir=logs / "v")
    drafter_target = ["--target", args.target] if args.target else []
    drafter = spawn("drafter", ["--kind", args.drafter, *drafter_target], log_dir=logs / "d")
    processes, results = [verifier, drafter], []
    try:
        verifier.wait_healthy(600)
        drafter.wait_healthy(120)
        for delay in (float(d) for d in args.delays.split(",")):
            port = free_port()
            proxy = subprocess.Popen(
                [
                    sys.executable,
                    str(HERE / "delay_proxy.py"),
                    "--listen",
                    f"127.0.0.1:{port}",
                    "--to",
                    drafter.address,
                    "--delay-ms",
                    str(delay),
                ]
            )
            coordinators = {
                mode: spawn(
                    "coordinator",
                    ["--verifier", verifier.address, "--drafter", f"127.0.0.1:{port}", *extra],
                    log_dir=logs / f"{mode}-{delay}",
                )
                for mode, extra in (("sync", []), ("overlap", ["--overlap-drafting"]))
            }
            try:
                for c in coordinators.values():
                    c.wait_healthy(120)
                clients = {m: CoordinatorClient(c.address) for m, c in coordinators.items()}
                seconds = {m: 0.0 for m in clients}
                tokens, predrafted, rounds, identical = 0, 0, 0, 0
                for prompt in prompts:
                    outs = {}
                    for mode, client in clients.items():  # alternate: noise hits both alike
                        start = time.perf_counter()
                        outs[mode] = client.generate(
                            make_request(
                                prompt_ids=prompt,
                                max_tokens=args.max_tokens,
                                num_draft_tokens=args.num_draft_tokens or None,
                            )
                        )
                        seconds[mode] += time.perf_counter() - start
                    tokens += len(outs["sync"].token_ids)
                    identical += outs["sync"].token_ids == outs["overlap"].token_ids
                    predrafted += outs["overlap"].stats.get("predrafted_rounds", 0)
                    rounds += outs["overlap"].stats["rounds"]
                row = {
                    "drafter": args.drafter,
                    "k": args.num_draft_tokens or "adaptive",
                    "delay_ms": delay,
                    "questions": len(prompts),
                    "tokens": tokens,
                    "sync_s": seconds["sync"],
                    "overlap_s": seconds["overlap"],
                    "speedup": seconds["sync"] / seconds["overlap"],
                    "predrafted_rounds": predrafted,
                    "rounds": rounds,
                    "identical": identical,
                }
                results.append(row)
                print(json.dumps(row), flush=True)
            finally:
                for c in coordinators.values():
                    c.stop()
                proxy.terminate()
                proxy.wait()
    finally:
        for process in processes:
            process.stop()


if __name__ == "__main__":
    main()
