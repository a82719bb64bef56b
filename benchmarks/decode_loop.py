"""Plain decoding three ways, in one process, on the same prompt: mlx-lm's generate_step,
one verify call per token (what a verify-only round does), and the verifier's burst decode
(`engine.decode`, what `VerifyRequest.plain_steps` runs), the last with whole forwards on
numpy (the default for a Llama-family target, specd.cpu.llama), with only the weight
products on numpy (specd.cpu.gemv), and all in MLX (`--gemv-rows 0`). `mlx_lm_wrapped` runs
mlx-lm's loop on the verifier's model (capture wrappers, gemv products). Reports ms per token
after prefill.

    python -m specd.platform exec -- python benchmarks/decode_loop.py [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import generate_step

from specd.models.load import load_target
from verifier_svc.engine import Target, decode, prefill, verify


def mlx_lm_ms(model, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    out, first_at = [], None
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=tokens + 1):
        out.append(token)
        if first_at is None:
            first_at = time.perf_counter()  # prefill and the first token are done
    return 1000 * (time.perf_counter() - first_at) / tokens, out


def per_token_ms(target: Target, prompt: list[int], tokens: int, capture) -> tuple[float, list]:
    session = prefill(target, prompt, capture).session
    out = [session.last_token]
    start = time.perf_counter()
    for _ in range(tokens):
        out += verify(target, session, []).committed
    return 1000 * (time.perf_counter() - start) / tokens, out


def burst_ms(target: Target, prompt: list[int], tokens: int, capture, burst: int):
    session = prefill(target, prompt, capture).session
    out = [session.last_token]
    start = time.perf_counter()
    while len(out) <= tokens:
        out += decode(target, session, min(burst, tokens + 1 - len(out))).committed
    return 1000 * (time.perf_counter() - start) / tokens, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=150)
    parser.add_argument("--burst", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    plain_model = load_target(args.model, "float32").model  # without the capture wrappers
    target = Target(load_target(args.model, "float32"))  # few-token forwards on numpy
    gemv_products = Target(load_target(args.model, "float32"), gemv_rows=3)
    # MLX layers around numpy products, without whole CPU layers: the MLX backend alone
    gemv_products.forwards = [f for f in gemv_products.forwards if f.queues]
    mlx_products = Target(load_target(args.model, "float32"), gemv_rows=0)
    capture = (2, 15, 27)[: target.identity.num_layers]
    prompt = [100 + (i * 37) % 5000 for i in range(args.prompt_tokens)]
    ways = {
        "mlx_lm": lambda: mlx_lm_ms(plain_model, prompt, args.tokens),
        "mlx_lm_wrapped": lambda: mlx_lm_ms(target.model, prompt, args.tokens),
        "verify_per_token": lambda: per_token_ms(target, prompt, args.tokens, ()),
        "burst": lambda: burst_ms(target, prompt, args.tokens, (), args.burst),
        "burst_gemv_products": lambda: burst_ms(gemv_products, prompt, args.tokens, (), args.burst),
        "burst_mlx_products": lambda: burst_ms(mlx_products, prompt, args.tokens, (), args.burst),
        "burst_capture": lambda: burst_ms(target, prompt, args.tokens, capture, args.burst),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    outputs = {}
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits all alike
        for name, way in ways.items():
            ms, out = way()
            times[name].append(ms)
            outputs[name] = out[: args.tokens + 1]
    reference = outputs["mlx_lm"]
    print(json.dumps({
        "tokens": args.tokens,
        "burst": args.burst,
        "ms_per_token": {n: round(statistics.median(t), 2) for n, t in times.items()},
        "identical": {n: o == reference for n, o in outputs.items()},
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
