"""Where a served round's time goes: one stack of the three services, py-spy sampling each
service's process while a client generates, then each process's threads and busiest frames,
beside the verifier's own load lines ("a call held X ms (Y waiting), away Z ms between calls").

    python benchmarks/round_profile.py [--target T] [--dtype float32] [--drafter eagle3] [--k 3]
        [--seconds 20] [--rate 1000] [--py-spy PATH] [--out DIR]

py-spy (PyPI `py-spy`) is not a dependency of specd: give its binary with --py-spy where it is
not on PATH (a lent GPU: the wheel carried and unzipped). Sampling slows the services (three
processes sampled a thousand times a second), so read the shares, not the speed.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import time
from pathlib import Path

from specd.client import CoordinatorClient, make_request
from specd.launch import Stack

QUESTION = "Explain how a hash map works and give an example in Python."


def summary(raw: Path, top: int) -> str:
    """py-spy's raw output (one `frame;frame;... count` line a stack) as its threads' samples,
    the frames most often on top, and the frames most often anywhere in a stack."""
    threads, leaves, within = collections.Counter(), collections.Counter(), collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames, n = stack.split(";"), int(count)
        threads[frames[0]] += n
        leaves[frames[-1]] += n
        for frame in set(frames):
            within[frame] += n
    lines = [f"  threads: {dict(threads.most_common())}", "  on top:"]
    lines += [f"    {n:6d} {frame}" for frame, n in leaves.most_common(top)]
    lines.append("  anywhere:")
    lines += [f"    {n:6d} {frame}" for frame, n in within.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="model (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--drafter", default="eagle3", help="ngram, eagle3, dflash or none")
    parser.add_argument("--k", type=int, default=3, help="drafts a round, pinned")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=20.0, help="sampled")
    parser.add_argument("--rate", type=int, default=1000, help="samples a second")
    parser.add_argument("--py-spy", default=shutil.which("py-spy"), help="its binary")
    parser.add_argument(
        "--idle", action="store_true", help="sample threads blocked in a wait too (py-spy --idle)"
    )
    parser.add_argument("--native", action="store_true", help="C and C++ frames too")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path, default=Path("round-profile"))
    args = parser.parse_args()
    if not args.py_spy:
        parser.error("py-spy not found: pip install py-spy, or give its binary with --py-spy")
    args.out.mkdir(parents=True, exist_ok=True)
    drafter = None if args.drafter == "none" else args.drafter
    stack = Stack(
        target=args.target,
        drafter=drafter,
        dtype=args.dtype,
        verifier_args=["--log-stats", "1"],
        coordinator_args=["--no-adaptive"],
        log_dir=args.out / "logs",
    )
    with stack:
        client = CoordinatorClient(stack.coordinator)
        request = make_request(
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=args.max_tokens,
            num_draft_tokens=args.k if drafter else None,
        )
        for _ in range(3):  # first shapes and caches
            client.generate(request)
        spies = {
            name: subprocess.Popen(
                [
                    args.py_spy,
                    "record",
                    "--rate",
                    str(args.rate),
                    "--duration",
                    str(round(args.seconds)),
                    "--threads",
                    "--format",
                    "raw",
                    "--output",
                    str(args.out / f"{name}.txt"),
                    "--pid",
                    str(service.process.pid),
                    *(["--idle"] if args.idle else []),
                    *(["--native"] if args.native else []),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            for name, service in stack.services.items()
        }
        time.sleep(1.0)  # py-spy attached
        start, tokens = time.perf_counter(), 0
        while time.perf_counter() - start < args.seconds - 2:
            tokens += len(client.generate(request).token_ids)
        rate = tokens / (time.perf_counter() - start)
        for spy in spies.values():
            spy.wait()
    print(f"{args.drafter}, k = {args.k}: {rate:.1f} tok/s while sampled")
    for name in spies:
        raw = args.out / f"{name}.txt"
        print(f"{name}:\n{summary(raw, args.top) if raw.exists() else '  no samples'}")
    log = args.out / "logs" / "verifier.log"
    print("verifier's load lines:")
    print("\n".join(line for line in log.read_text().splitlines() if " last " in line))


if __name__ == "__main__":
    main()
