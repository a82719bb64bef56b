"""Why the verifier service's forwards can run slower than the same decode in another process.

On the H200 the verifier service decoded 4 tokens in 26 ms of its own compute while the same
engine call took 19.5 ms in the benchmark's process. This runs, each in a fresh process and in
a rotating order over --rounds rounds (a lent host's processes differ among themselves), the
verifier's decode of --burst tokens as:
  engine process     the engine alone on an MLX worker thread (no gRPC, no warm-up)
  service            the verifier service, its default warm-up, called over gRPC
  service, minimal   the same with --warmup minimal
  service, no BLAS preload   the same without OpenBLAS preloaded into it
and prints each variant's median compute per call (the verifier's own clock). This process
never touches the device, so no second context shares it.

    python benchmarks/verifier_slowdown.py [--target DIR] [--dtype float32] [--rounds 2]
        [--variants engine,service,minimal,no-preload]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from specd.launch import spawn

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from call_overhead import verify_calls  # noqa: E402 - a sibling script, found by the path above


def engine_process(args) -> float:
    """Median compute per decode in a fresh process (benchmarks/warmup_effect.py's child)."""
    model = ["--target", args.target] if args.target else []
    cmd = [sys.executable, str(HERE / "warmup_effect.py"), "--child", "--dtype", args.dtype,
           "--warmup", "minimal", "--after", "0", "--calls", str(args.calls),
           "--burst", str(args.burst), *model]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return float(re.findall(r"before\s+([\d.]+) ms", out)[-1]) / 1000


def service(args, flags: list[str], env: dict[str, str] | None) -> float:
    """Median verifier compute per Verify(plain_steps) call of a fresh verifier service."""
    logs = Path(tempfile.mkdtemp(prefix="slowdown-"))
    model = ["--model", args.target] if args.target else []
    verifier = spawn("verifier", [*model, "--dtype", args.dtype, *flags], log_dir=logs, env=env)
    prompt = [(17 * i + 3) % 200 + 50 for i in range(args.context)]
    try:
        verifier.wait_healthy(900)
        verify_calls(verifier.address, 8, args.burst, prompt)  # a first session's calls aside
        _, computes = verify_calls(verifier.address, args.calls, args.burst, prompt)
    finally:
        verifier.stop()
    return statistics.median(computes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="model (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=30, help="decodes per measurement")
    parser.add_argument("--burst", type=int, default=4, help="tokens per decode")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens (made up)")
    parser.add_argument(
        "--variants", help="comma-separated subset of: engine, service, minimal, no-preload"
    )
    args = parser.parse_args()

    unpreloaded = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    variants = {
        "engine process": lambda: engine_process(args),
        "service": lambda: service(args, [], None),
        "service, minimal": lambda: service(args, ["--warmup", "minimal"], None),
        "service, no BLAS preload": lambda: service(args, ["--warmup", "minimal"], unpreloaded),
    }
    short = dict(zip(("engine", "service", "minimal", "no-preload"), variants, strict=True))
    names = [short[v] for v in args.variants.split(",")] if args.variants else list(variants)
    results: dict[str, list[float]] = {name: [] for name in names}
    for turn in range(args.rounds):
        for name in names[turn % len(names) :] + names[: turn % len(names)]:
            results[name].append(variants[name]())
            print(f"round {turn + 1}: {name} {1000 * results[name][-1]:.2f} ms", flush=True)
    print(f"median compute per decode of {args.burst} tokens ({args.calls} calls), "
          f"{args.rounds} fresh processes each")  # fmt: skip
    for name, values in results.items():
        spread = " ".join(f"{1000 * v:.2f}" for v in values)
        print(f"  {name:<26} {1000 * statistics.median(values):8.2f} ms   ({spread})")


if __name__ == "__main__":
    main()
