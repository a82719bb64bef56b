"""Forward cost against tokens per forward, and the decode step against the device's launch floor.

For each dtype and context length: the median time of one target forward of T tokens appended at
the end of a cache of that many tokens (then trimmed back), split into building the graph in
Python and waiting for the device. Then the decode step as mlx-lm runs it (the next forward
queued before the current token is read) and one at a time (each token read before the next
forward is built), against two floors: an empty evaluation (one trivial kernel and the
host-device round trip) and the launch cost per kernel (a chain of small kernels, per kernel).

    python benchmarks/gpu_forwards.py [--model DIR] [--dtypes native float32]
        [--contexts 512 2048] [--tokens 1 2 4 8 16 32 64] [--variants mlx-lm rowwise]
        [--json OUT]

Variant rowwise: the same model with specd.models.rowwise installed (a few tokens computed as
decode steps compute them); beside its cost, how far a forward of N tokens is from N decode
steps (max |dlogit| and greedy choices that differ), for both variants. Variant compiled:
specd.models.compiled's forward (the work between attentions under mx.compile), its rows
against its own steps and against mlx-lm's; variant compiled-chunked: the same with attention
in MLX's chunks of three rows instead of specd.models.row_attention's one launch.

On a GPU this is what adaptive k needs to know: how much a verify of k+1 tokens costs over a
decode step. Runs on a CPU too (slowly).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

from specd.models import compiled, rowwise
from specd.models.load import device_kind, load_target


def _median_ms(samples: list[float]) -> float:
    return round(1000 * statistics.median(samples), 3)


def launch_floor(repeats: int = 50, chain: int = 200) -> dict:
    """ms of an evaluation of one tiny kernel, and per kernel of a chain of tiny kernels."""
    x = mx.ones((16,))
    mx.eval(x)
    one, chained = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(x + 1)
        one.append(time.perf_counter() - start)
        y = x
        start = time.perf_counter()
        for i in range(chain):
            y = y * 1.0001 + i  # two kernels a link unless fused
        mx.eval(y)
        chained.append((time.perf_counter() - start) / (2 * chain))
    return {"empty_eval_ms": _median_ms(one), "per_kernel_ms": _median_ms(chained)}


def _trim(cache: list, keep: int) -> None:
    from mlx_lm.models.cache import trim_prompt_cache

    excess = cache[0].offset - keep
    if excess > 0:
        trim_prompt_cache(cache, excess)


def _prefilled(model, context: int) -> list:
    """A cache holding `context` made-up tokens, filled in chunks of 512."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    tokens = mx.array([(17 * i + 3) % 1000 + 100 for i in range(context)])
    for start in range(0, context, 512):
        model(tokens[None, start : start + 512], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def forward_costs(model, context: int, sizes: list[int], repeats: int) -> dict:
    """Per size: median build and total ms of one forward at the end of `context` tokens,
    and the first call's total (what a size costs the first time it is seen)."""
    cache = _prefilled(model, context)
    out = {}
    for n in sizes:
        block = mx.array([(31 * i + 7) % 1000 + 100 for i in range(n)])
        builds, totals, first = [], [], None
        for r in range(repeats + 1):
            start = time.perf_counter()
            logits = model(block[None], cache=cache)
            built = time.perf_counter()
            mx.eval(mx.argmax(logits[0], axis=-1))
            done = time.perf_counter()
            _trim(cache, context)
            if r == 0:
                first = done - start
                continue
            builds.append(built - start)
            totals.append(done - start)
        out[n] = {
            "ms": _median_ms(totals),
            "build_ms": _median_ms(builds),
            "first_ms": round(1000 * first, 3),
        }
    return out


def rows_against_steps(model, context: int, sizes: list[int], stepper=None) -> dict:
    """Per size N: a forward of N tokens at the end of `context` against N decode steps over
    the same tokens (by `stepper`, default the model): max |dlogit|, and how many greedy
    choices differ."""
    stepper = stepper or model
    cache = _prefilled(model, context)
    out = {}
    for n in sizes:
        block = mx.array([(29 * i + 11) % 1000 + 100 for i in range(n)])
        steps = []
        for i in range(n):
            steps.append(stepper(block[None, i : i + 1], cache=cache)[0])
        steps = mx.concatenate(steps)
        mx.eval(steps)
        _trim(cache, context)
        whole = model(block[None], cache=cache)[0]
        mx.eval(whole)
        _trim(cache, context)
        diff = mx.abs(whole.astype(mx.float32) - steps.astype(mx.float32)).max().item()
        flips = (mx.argmax(whole, axis=-1) != mx.argmax(steps, axis=-1)).sum().item()
        out[n] = {"max_dlogit": diff, "choices_differ": flips}
    return out


def decode_rates(model, context: int, steps: int = 128) -> dict:
    """Tokens/s of greedy decoding after `context` tokens: pipelined as mlx-lm does, and
    synchronous (each token read before the next forward is built)."""

    def step(token, cache):
        return mx.argmax(model(token[None], cache=cache)[0, -1:], axis=-1)

    rates = {}
    for mode in ("pipelined", "synchronous", "pipelined", "synchronous"):  # each twice
        cache = _prefilled(model, context)
        token = mx.array([42])
        start = time.perf_counter()
        if mode == "pipelined":
            nxt = step(token, cache)
            mx.async_eval(nxt)
            for _ in range(steps - 1):
                following = step(nxt, cache)
                mx.async_eval(following)
                nxt.item()
                nxt = following
            nxt.item()
        else:
            for _ in range(steps):
                token = mx.array([step(token, cache).item()])
        rate = steps / (time.perf_counter() - start)
        rates[mode] = max(rates.get(mode, 0.0), rate)  # the better of two: warm-up in the first
    return {k: round(v, 1) for k, v in rates.items()} | {
        "pipelined_ms_per_token": round(1000 / rates["pipelined"], 3),
        "synchronous_ms_per_token": round(1000 / rates["synchronous"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="target (default: the embedded SmolLM2)")
    parser.add_argument("--dtypes", nargs="+", default=["native", "float32", "float16"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--decode-steps", type=int, default=128)
    parser.add_argument("--variants", nargs="+", default=["mlx-lm", "rowwise"])
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args()

    result = {"device": device_kind(), "mlx": mx.__version__, "floor": launch_floor()}
    print(f"device {result['device']}, mlx {result['mlx']}; launch floor: "
          f"empty eval {result['floor']['empty_eval_ms']} ms, "
          f"{result['floor']['per_kernel_ms']} ms per kernel in a chain")  # fmt: skip
    result["dtypes"] = {}
    for dtype in args.dtypes:
        for variant in args.variants:
            loaded = load_target(args.model, dtype)
            if variant == "rowwise" and not rowwise.install(loaded.model):
                print(f"{loaded.dtype}: rowwise does not apply to this model; skipped")
                continue
            fused = variant.startswith("compiled")
            if fused and not compiled.supports(loaded.model):
                print(f"{loaded.dtype}: compiled does not apply to this model; skipped")
                continue
            model = loaded.model
            if fused:
                model = compiled.CompiledForward(model, one_launch_attention=variant == "compiled")
            name = f"{loaded.dtype}/{variant}"
            entry = {"contexts": {}, "decode": {}, "rows_vs_steps": {}}
            for context in args.contexts:
                costs = forward_costs(model, context, args.tokens, args.repeats)
                entry["contexts"][context] = costs
                entry["decode"][context] = decode_rates(model, context, args.decode_steps)
                exact = rows_against_steps(model, context, args.tokens)
                entry["rows_vs_steps"][context] = exact
                if fused:
                    against = rows_against_steps(model, context, args.tokens, loaded.model)
                    entry.setdefault("rows_vs_mlx_lm_steps", {})[context] = against
                    print(f"{name:>16} ctx {context:>5}: N tokens vs N mlx-lm steps  " + "  ".join(
                        f"{n}:{e['max_dlogit']:.2g} ({e['choices_differ']})"
                        for n, e in against.items()))  # fmt: skip
                one = costs[args.tokens[0]]["ms"]
                cells = "  ".join(
                    f"{n}:{c['ms']:.2f} ({c['ms'] / one:.2f}x, build {c['build_ms']:.2f})"
                    for n, c in costs.items()
                )
                d = entry["decode"][context]
                print(f"{name:>16} ctx {context:>5}: ms per forward of N tokens  {cells}")
                print(f"{'':>16} ctx {context:>5}: decode {d['pipelined']} tok/s pipelined "
                      f"({d['pipelined_ms_per_token']} ms), {d['synchronous']} tok/s "
                      f"synchronous ({d['synchronous_ms_per_token']} ms)")  # fmt: skip
                print(f"{'':>16} ctx {context:>5}: N tokens vs N steps, max |dlogit| (choices "
                      "that differ)  " + "  ".join(
                          f"{n}:{e['max_dlogit']:.2g} ({e['choices_differ']})"
                          for n, e in exact.items()))  # fmt: skip
            result["dtypes"][name] = entry
            del loaded, model
            mx.clear_cache()
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
