"""Host time to build a step's graph of every decoder layer over many rows, three ways: one
`mx.compile` call a layer (as the verifier's compiled forwards run), one compiled call over all
layers, and no compilation. The layers are Llama-shaped with the embedded model's sizes and
random weights (q/k/v and gate/up joined, RoPE, attention over a cache of `--context` keys plus
the new rows); only the build is timed, not the evaluation after it, so the figures hold on a
CPU as on a GPU's host, where a small model's batched step is bound by building and launching.

    python benchmarks/compiled_calls.py [--rows 16] [--context 80] [--builds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from specd.argtypes import positive_int
from specd.models.load import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="model whose sizes to take (default: the embedded one)")
    parser.add_argument(
        "--rows", type=positive_int, default=16, help="rows a step (one per session)"
    )
    parser.add_argument(
        "--context", type=positive_int, default=80, help="cached keys a row attends"
    )
    parser.add_argument("--builds", type=positive_int, default=30, help="timed builds a way")
    args = parser.parse_args()
    a = load_target(args.target, "float32").model.args
    heads, kv_heads, width = a.num_attention_heads, a.num_key_value_heads, a.hidden_size
    head_dim = getattr(a, "head_dim", None) or width // heads
    ffn, rows, context = a.intermediate_size, args.rows, args.context
    q_width, kv_width = heads * head_dim, kv_heads * head_dim

    def rope(x):
        return mx.fast.rope(x, head_dim, traditional=False, base=a.rope_theta, scale=1.0,
                            offset=context)  # fmt: skip

    def layer(h, w, keys, values):
        x = mx.fast.rms_norm(h, w["in"], a.rms_norm_eps)
        qkv = x @ w["qkv"]
        q = rope(qkv[:, :q_width].reshape(rows, heads, 1, head_dim))
        k = rope(qkv[:, q_width : q_width + kv_width].reshape(rows, kv_heads, 1, head_dim))
        v = qkv[:, q_width + kv_width :].reshape(rows, kv_heads, 1, head_dim)
        k_all = mx.concatenate([keys, k], axis=2)
        v_all = mx.concatenate([values, v], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, k_all, v_all, scale=head_dim**-0.5)
        h = h + out.reshape(rows, q_width) @ w["o"]
        x = mx.fast.rms_norm(h, w["post"], a.rms_norm_eps)
        gate, up = mx.split(x @ w["gate_up"], 2, axis=-1)
        return h + (gate * mx.sigmoid(gate) * up) @ w["down"], k, v

    def every_layer(h, weights, caches):
        new = []
        for w, (keys, values) in zip(weights, caches, strict=True):
            h, k, v = layer(h, w, keys, values)
            new.append((k, v))
        return h, new

    def normal(*shape):
        return mx.random.normal(shape) * 0.02

    weights = [
        {"in": mx.ones((width,)), "qkv": normal(width, q_width + 2 * kv_width),
         "o": normal(q_width, width), "post": mx.ones((width,)),
         "gate_up": normal(width, 2 * ffn), "down": normal(ffn, width)}
        for _ in range(a.num_hidden_layers)
    ]  # fmt: skip
    caches = [(normal(rows, kv_heads, context, head_dim), normal(rows, kv_heads, context, head_dim))
              for _ in weights]  # fmt: skip
    h0 = normal(rows, width)
    mx.eval(weights, caches, h0)
    a_layer, all_layers = mx.compile(layer), mx.compile(every_layer)

    def layer_calls():
        h, new = h0, []
        for w, (keys, values) in zip(weights, caches, strict=True):
            h, k, v = a_layer(h, w, keys, values)
            new.append((k, v))
        return h, new

    ways = {
        "a compiled call a layer": layer_calls,
        "one compiled call, every layer": lambda: all_layers(h0, weights, caches),
        "not compiled": lambda: every_layer(h0, weights, caches),
    }
    builds: dict[str, list[float]] = {name: [] for name in ways}
    for build in range(args.builds + 3):  # the first builds trace the compiled ones
        for name, way in ways.items():  # rotated, so a slow spell of the host hits all
            start = time.perf_counter()
            out = way()
            built = time.perf_counter() - start
            mx.eval(out)
            if build >= 3:
                builds[name].append(built)
    print(f"{a.num_hidden_layers} layers, {rows} rows over {context} cached keys, device "
          f"{mx.default_device()}; ms to build a step's graph, median of "
          f"{args.builds}")  # fmt: skip
    for name, times in builds.items():
        print(f"  {name:32s} {1000 * statistics.median(times):7.2f}")


if __name__ == "__main__":
    main()
