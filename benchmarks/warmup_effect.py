"""The verifier's decode before and after its warm-up, in fresh processes.

On the H200 a decode in a warmed-up verifier ran slower than the same decode elsewhere, and
fresh processes there differ among themselves; this runs --processes fresh processes, each
timing 4-token decodes (the verifier's engine on an MLX worker thread, as the service runs it)
twice before the warm-up and --after times after it. Environment variables such as
MLX_CUDA_GRAPH_CACHE_SIZE pass through to the processes.

    python benchmarks/warmup_effect.py [--target DIR] [--warmup full|minimal] [--processes 3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def one_process(args) -> None:
    from call_overhead import engine_calls

    from specd import mlx_settings

    mlx_settings.apply()
    from specd.models.load import device_kind
    from specd.service import MlxThread
    from verifier_svc.config import VerifierConfig
    from verifier_svc.servicer import target_for
    from verifier_svc.warmup import warm_up

    on_gpu = device_kind() == "gpu"
    target = target_for(VerifierConfig(model=args.target, dtype=args.dtype))
    worker = MlxThread(inline_rounds=False)

    def on_worker(fn, *a):
        return worker.submit(fn, *a).result()

    prompt = [(17 * i + 3) % 200 + 50 for i in range(args.context)]

    def line(label: str) -> None:
        _, compute = engine_calls(target, args.calls, args.burst, prompt, on_worker, on_gpu)
        print(f"  {label:<16} {1000 * compute:8.2f} ms", flush=True)

    engine_calls(target, 8, 1, prompt, on_worker, on_gpu)  # first calls of a shape aside
    line("before")
    line("before")
    report = on_worker(warm_up, target, VerifierConfig.max_draft_tokens, args.warmup)
    print(f"  warm-up {report.mode}: {report.calls} calls in {report.seconds:.1f} s", flush=True)
    for i in range(args.after):
        line(f"after {i + 1}")
    worker.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="model (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--warmup", choices=["full", "minimal"], default="full")
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--after", type=int, default=4, help="lines after the warm-up")
    parser.add_argument("--calls", type=int, default=30, help="decodes per line (median)")
    parser.add_argument("--burst", type=int, default=4, help="tokens per decode")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens (made up)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        one_process(args)
        return
    print(f"median compute of {args.calls} decodes of {args.burst} tokens, "
          f"{args.warmup} warm-up, {args.processes} fresh processes")  # fmt: skip
    for n in range(args.processes):
        print(f"process {n + 1}", flush=True)
        subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], check=True)


if __name__ == "__main__":
    main()
