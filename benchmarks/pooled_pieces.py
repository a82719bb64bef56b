"""What the pooled batch's attention costs per layer, piece by piece, against the whole forward:
for N pooled sessions taking one plain step each, every decoder layer's

- write: the new keys and values scattered into the pool (`KVPool.write`), two scatters a
  layer; write, one scatter: the same rows of every layer's keys and values in one scatter
  into one array (what a pool kept as one array for all layers would launch);
- gather: each session's keys and values taken from the pool by slot (`kv_pool._attend`);
- slice: the same rows as a slice (made contiguous), where the sessions' slots run in order;
- attention, masked: the batch's attention through its mask, on keys already gathered;
- attention, unmasked: the same without the mask (a lower bound: the mask is what keeps a
  session to its own keys);
- no gather, every slot: the masked attention over the pool's whole grid as it lies, the
  queries placed at their sessions' slots, the batch's rows taken from its output (no copy of
  any keys, the idle slots' attention computed for nothing);
- pool kernel: every row's attention in one CUDA launch reading its own slot in place
  (specd.models.pool_attention, the verifier's --pool-kernel; where it runs);

each repeated over the model's layers in one graph, as a forward runs them, and timed with the
host's part (building the graph) apart. On a GPU, where a small model's step is bound by
launches rather than by arithmetic, the sum of the pieces against the whole pooled forward
(`pooled_mix.py`) says which of them a cheaper pooled attention must remove.

    python benchmarks/pooled_pieces.py [--target DIR] [--dtype float32] [--sessions 16 64]
        [--calls 20] [--context 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np
from pooled_mix import pooled_sessions, pooled_target, variant_switch  # this directory

from specd.cpu.llama import Segment
from specd.models import few_rows, pool_attention
from verifier_svc.engine import Target, _rollback
from verifier_svc.kv_pool import PooledStep


def timed(build, calls: int) -> tuple[float, float]:
    """Median ms of building a graph and of building and evaluating it."""
    totals, builds = [], []
    for call in range(calls + 2):  # the first two compile the shapes
        start = time.perf_counter()
        outs = build()
        built = time.perf_counter()
        mx.eval(outs)
        if call >= 2:
            totals.append(time.perf_counter() - start)
            builds.append(built - start)
    return 1000 * statistics.median(totals), 1000 * statistics.median(builds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="model (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--sessions", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--calls", type=int, default=20, help="timed graphs per piece")
    parser.add_argument("--context", type=int, default=64, help="the shortest prompt's tokens")
    parser.add_argument(
        "--few-rows-layout",
        choices=["auto", *sorted(few_rows.LAYOUTS)],
        help="the few-row kernel's layout for up to 16 sessions (default: the shipped one)",
    )
    args = parser.parse_args()
    if args.few_rows_layout:
        few_rows.use(args.few_rows_layout)
    target = pooled_target(args.target, args.dtype)
    rng = np.random.default_rng(0)
    print(f"device {mx.default_device()}, {len(target.model.layers)} layers; ms per graph of "
          f"every layer's piece (the host's part building it in brackets), median of "
          f"{args.calls}; few-row layout {few_rows.layout_name()}")  # fmt: skip
    for count in args.sessions:
        measure(target, pooled_sessions(target, count, args.context, rng), args.calls, rng)


def measure(target: Target, sessions: list, calls: int, rng: np.random.Generator) -> None:
    pool, layers, count = target.kv_pool, len(target.model.layers), len(sessions)
    config = target.model.args
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    width = config.hidden_size // heads
    scale = width**-0.5
    dtype = target.model.layers[0].self_attn.q_proj.weight.dtype
    vocab = target.identity.vocab_size
    step = PooledStep.of([s.cache[0] for s in sessions], 1)
    pool.reserve(int(step.offsets.max()) + 1)
    seen = step.mask.shape[-1]
    new_keys = mx.random.normal((count, kv_heads, 1, width)).astype(dtype)
    queries = mx.random.normal((count, heads, 1, width)).astype(dtype)
    rows = pool.new_rows(step.slots, step.offsets, kv_heads, 1)
    first = int(step.slots[0])
    in_order = bool((step.slots == np.arange(first, first + count)).all())

    def write():
        for layer in range(layers):
            pool.write(layer, rows, new_keys, new_keys)
        return [a for layer in range(layers) for a in pool.arrays(layer)]

    # every layer's keys and values in one array: what the writes would cost as one scatter
    # a forward (a pool stored so, attention reading a step's new rows from the step itself)
    flat = pool.arrays(0)[0]
    every_layer = mx.zeros((2 * layers * flat.shape[0], width), dtype)
    layer_rows = (np.arange(2 * layers)[:, None] * flat.shape[0] + np.array(rows)[None]).reshape(-1)
    layer_rows = mx.array(layer_rows.astype(np.int32))
    stacked = mx.concatenate([new_keys.reshape(-1, width)] * (2 * layers))

    def write_once():
        every_layer[layer_rows] = stacked
        return [every_layer]

    def gather():
        out = []
        for layer in range(layers):
            keys, values = (pool.grid(a)[:, :, :seen] for a in pool.arrays(layer))
            out += [
                mx.take(keys, step.slot_index, axis=0),
                mx.take(values, step.slot_index, axis=0),
            ]
        return out

    def sliced():
        out = []
        for layer in range(layers):
            keys, values = (
                pool.grid(a)[first : first + count, :, :seen] for a in pool.arrays(layer)
            )
            out += [mx.contiguous(keys), mx.contiguous(values)]
        return out

    gathered = gather()
    mx.eval(gathered)

    def attention(mask):
        def run():
            return [
                mx.fast.scaled_dot_product_attention(
                    queries, gathered[2 * layer], gathered[2 * layer + 1], scale=scale, mask=mask
                )
                for layer in range(layers)
            ]

        return run

    every_slot = mx.zeros((pool.slots, heads, 1, width), dtype)
    every_mask = mx.zeros((pool.slots, 1, 1, seen), mx.bool_)
    every_slot[step.slot_index], every_mask[step.slot_index] = queries, step.mask

    def over_every_slot():
        out = []
        for layer in range(layers):
            keys, values = (pool.grid(a)[:, :, :seen] for a in pool.arrays(layer))
            attended = mx.fast.scaled_dot_product_attention(
                every_slot, keys, values, scale=scale, mask=every_mask
            )
            out.append(mx.take(attended, step.slot_index, axis=0))
        return out

    def whole():
        segments = [Segment(rng.integers(100, vocab - 1, 1), s.cache) for s in sessions]
        outs = target._mlx.forward_pooled(segments, frozenset())
        for s in sessions:
            _rollback(s.cache, s.position - 1)
        return [logits for logits, _ in outs]

    pieces = {"gather": gather, "attention, masked": attention(step.mask),
              "attention, unmasked": attention(None), "write": write,
              "write, one scatter": write_once}  # fmt: skip
    if in_order:
        pieces["slice"] = sliced
    pieces["no gather: every slot"] = over_every_slot
    compiled = target._mlx.compiled_pooled
    kernel = compiled is not None and compiled.pool_kernel
    if kernel:
        info = pool_attention.row_info(step.slots, step.offsets, np.ones(count, int))
        info = mx.array(info)
        flat_queries = queries.reshape(count, heads, width)

        def in_place():
            return [
                pool_attention.attend(
                    flat_queries, *(pool.grid(a) for a in pool.arrays(layer)), info, scale
                )
                for layer in range(layers)
            ]

        pieces["pool kernel"] = in_place
    print(f"{count} sessions, {seen} keys at most, slots in order: {in_order}")
    for name, build in pieces.items():
        total, built = timed(build, calls)
        print(f"  {name:20s} {total:7.2f} ms ({built:.2f})")
    variants = ["own", "compiled", "kernel"] if kernel else ["own", "compiled"]
    use_variant = variant_switch(target, variants)
    for variant in variants:
        use_variant(variant)
        total, built = timed(whole, calls)
        print(f"  whole forward, {variant:8s} {total:7.2f} ms ({built:.2f})")
    use_variant("kernel" if kernel else "compiled")


if __name__ == "__main__":
    main()
