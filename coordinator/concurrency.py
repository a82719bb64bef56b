"""`specd bench --concurrency 1,4,16`: many clients at once, against mlx-lm's batched plain
generation of the same prompts on the same device.

At each level N, N clients each send --concurrency-requests requests one after the other (the
prompts taken in turn from the question set) to one stack per drafter; the table gives the
aggregate tokens per second (all tokens over the wall time of the level) and each request's
latency (p50, p99). mlx-lm's `batch_generate` runs the same N * requests prompts with a batch of
N. Every greedy output is compared with the same prompt's output at level 1.
"""

from __future__ import annotations

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MLX_LM_BATCHED = "mlx-lm batched"


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency takes client counts >= 1 such as 1,4,16; got {text!r}")
    return sorted(set(levels))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def level_row(level: int, tokens: int, wall_s: float, latencies: list[float], differ: int) -> dict:
    return {
        "clients": level,
        "requests": len(latencies),
        "tokens": tokens,
        "wall_s": round(wall_s, 3),
        "aggregate_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "p50_s": statistics.median(latencies),
        "p99_s": percentile(latencies, 0.99),
        "outputs_differing_from_solo": differ,
    }


def mlx_lm_batched(target, prompts: list[list[int]], levels: list[int], args) -> list[dict]:
    from mlx_lm.generate import batch_generate

    rows, solo = [], {}
    for level in levels:
        batch = _level_prompts(prompts, level, args.concurrency_requests)
        start = time.perf_counter()
        done = batch_generate(
            target.model, target.tokenizer, [ids for _, ids in batch], max_tokens=args.max_tokens,
            return_token_ids=True, completion_batch_size=level, prefill_batch_size=level,
        )  # fmt: skip
        wall = time.perf_counter() - start
        differ = _count_differing(solo, [i for i, _ in batch], done.token_ids)
        tokens = sum(len(ids) for ids in done.token_ids)
        rows.append(level_row(level, tokens, wall, [wall] * len(batch), differ))
    return rows


def services(client, request_of, prompts: list[list[int]], levels: list[int], args) -> list[dict]:
    rows, solo = [], {}
    for level in levels:
        batch = _level_prompts(prompts, level, args.concurrency_requests)
        start = time.perf_counter()
        outputs, latencies = _clients(client, request_of, batch, level)
        wall = time.perf_counter() - start
        differ = _count_differing(solo, [i for i, _ in batch], outputs)
        rows.append(level_row(level, sum(map(len, outputs)), wall, latencies, differ))
    return rows


def _clients(client, request_of, batch, level: int) -> tuple[list[list[int]], list[float]]:
    """`level` clients at once, client j sending requests j, j + level, ... in turn: each
    request's output ids (in batch order) and every request's latency."""
    outputs: list[list[int]] = [[] for _ in batch]
    latencies: list[float] = []

    def one_client(first: int) -> None:
        for n in range(first, len(batch), level):
            start = time.perf_counter()
            outputs[n] = list(client.generate(request_of(batch[n][1])).token_ids)
            latencies.append(time.perf_counter() - start)

    with ThreadPoolExecutor(level) as pool:
        list(pool.map(one_client, range(level)))
    return outputs, latencies


def _level_prompts(prompts, level: int, per_client: int) -> list[tuple[int, list[int]]]:
    """(prompt index, ids) for level * per_client requests, the prompts taken in turn."""
    return [(i % len(prompts), prompts[i % len(prompts)]) for i in range(level * per_client)]


def _count_differing(solo: dict, indices, outputs) -> int:
    """Outputs unlike the same prompt's at the first level (which sets them)."""
    differ = 0
    for index, ids in zip(indices, outputs, strict=True):
        if index not in solo:
            solo[index] = list(ids)
        elif list(ids) != solo[index]:
            differ += 1
    return differ


def run_concurrency(args, target, drafters: list[str], prompts, log_dir: Path) -> dict:
    from coordinator.bench import bench_request, bench_stack
    from specd.client import CoordinatorClient

    levels = parse_levels(args.concurrency)
    results = {MLX_LM_BATCHED: mlx_lm_batched(target, prompts, levels, args)}
    _print_rows(MLX_LM_BATCHED, results[MLX_LM_BATCHED])
    for d in drafters:
        with bench_stack(args, d, log_dir / f"concurrency-{d}") as stack:
            client = CoordinatorClient(stack.coordinator)
            client.generate(bench_request(prompts[0], args, d))  # the first request aside
            results[d] = services(client, lambda ids, d=d: bench_request(ids, args, d),
                                  prompts, levels, args)  # fmt: skip
            client.close()
        _print_rows(d, results[d])
    return results


def _print_rows(name: str, rows: list[dict]) -> None:
    print(f"{name}: clients  requests  aggregate tok/s  p50 s  p99 s  differing from solo",
          file=sys.stderr)  # fmt: skip
    for r in rows:
        print(f"  {r['clients']:>5} {r['requests']:>9} {r['aggregate_tok_s']:16.1f} "
              f"{r['p50_s']:6.2f} {r['p99_s']:6.2f}  {r['outputs_differing_from_solo']}",
              file=sys.stderr)  # fmt: skip


def write_concurrency(path: Path, results: dict[str, list[dict]]) -> None:
    """JSON of every level, a markdown table and a chart of aggregate tok/s and p99 latency."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    path.with_suffix(".md").write_text(concurrency_table(results) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: no chart (pip install 'specd[plot]' for matplotlib)", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in results.items():
        clients = [r["clients"] for r in rows]
        axes[0].plot(clients, [r["aggregate_tok_s"] for r in rows], marker="o", label=name)
        axes[1].plot(clients, [r["p99_s"] for r in rows], marker="o", label=name)
    for ax, title in zip(axes, ("aggregate tokens/s", "p99 request latency (s)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=100)
    plt.close(fig)


def concurrency_table(results: dict[str, list[dict]]) -> str:
    """Markdown: aggregate tok/s and latency per level, each service beside mlx-lm batched."""
    lines = [
        "| runner | clients | aggregate tok/s | vs mlx-lm batched | p50 s | p99 s | differing |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    plain = {r["clients"]: r["aggregate_tok_s"] for r in results.get(MLX_LM_BATCHED, [])}
    for name, rows in results.items():
        for r in rows:
            base = plain.get(r["clients"])
            ratio = f"{r['aggregate_tok_s'] / base:.2f}×" if base else "–"
            lines.append(
                f"| {name} | {r['clients']} | {r['aggregate_tok_s']:.1f} | {ratio} | "
                f"{r['p50_s']:.2f} | {r['p99_s']:.2f} | {r['outputs_differing_from_solo']} |"
            )
    return "\n".join(lines)
