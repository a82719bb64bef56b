"""`specd bench --concurrency 1,4,16`: many clients at once, against mlx-lm's batched plain
generation of the same prompts on the same device.

At each level N, N clients each send --concurrency-requests requests one after the other (the
prompts taken in turn from the question set) to one stack per drafter; the table gives the
aggregate tokens per second (all tokens over the wall time of the level) and each request's
latency (p50, p99). mlx-lm's `batch_generate` runs the same N * requests prompts with a batch of
N. Every greedy output is compared with the same prompt's output at level 1. With
--temperature each request is seeded from its prompt, and drafting off's outputs (one draw a
token, however the tokens are split into calls) are compared too; a drafter's sampled output
depends on how its rounds fall, and mlx-lm's has no seed of its own: not compared.

With --concurrency-faults the highest level runs a second time, and once every client's first
request is running the drafter is killed and the verifier killed and started again on its
address; the drafter comes back once the verifier serves. Every request must still complete,
with the output it had in the clean run.
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from coordinator.bench import logit_rounding
from coordinator.rounds import leading_matches

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


def level_row(
    level: int,
    tokens: int,
    wall_s: float,
    latencies: list[float],
    differ: int | None,
    failed: int = 0,
    stats: list | None = None,
) -> dict:
    """stats: the services' per-request GenerateStats, for how much they drafted."""
    row = {
        "clients": level,
        "requests": len(latencies),
        "tokens": tokens,
        "wall_s": round(wall_s, 3),
        "aggregate_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        # None where every request failed: the row still reports the failures
        "p50_s": statistics.median(latencies) if latencies else None,
        "p99_s": percentile(latencies, 0.99) if latencies else None,
        "outputs_differing_from_solo": differ,
        "failed": failed,
    }
    if stats:
        rounds = sum(s.rounds for s in stats)
        generated = sum(s.generated_tokens for s in stats)
        row["drafted_per_token"] = sum(s.drafted for s in stats) / max(1, generated)
        # under load a call's round trip keeps its session out of the forwards meanwhile
        row["verify_calls_per_token"] = sum(s.verify_calls for s in stats) / max(1, generated)
        row["draft_calls_per_token"] = sum(s.draft_calls for s in stats) / max(1, generated)
        # whether the verifier batched the level: per verifier call, weighted by calls
        calls = sum(s.verify_calls for s in stats)
        row["forward_sessions"] = (
            sum(s.forward_sessions * s.verify_calls for s in stats) / calls if calls else 1.0
        )
        row["tau"] = 1 + sum(s.accepted for s in stats) / rounds if rounds else 1.0
    return row


def mlx_lm_batched(target, prompts: list[list[int]], levels: list[int], args) -> list[dict]:
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    sampled = args.temperature > 0
    sampling = {"sampler": make_sampler(args.temperature)} if sampled else {}
    rows, solo = [], {}
    for level in levels:
        batch = _level_prompts(prompts, level, args.concurrency_requests)
        for max_tokens in (2, args.max_tokens):
            # the short pass meets the level's shapes first (a GPU compiles kernels for them),
            # as the services' warm-up and first request do; the second is the one timed
            start = time.perf_counter()
            done = batch_generate(
                target.model, target.tokenizer, [ids for _, ids in batch], max_tokens=max_tokens,
                return_token_ids=True, completion_batch_size=level, prefill_batch_size=level,
                **sampling,
            )  # fmt: skip
        wall = time.perf_counter() - start
        differ = None if sampled else len(_differences(solo, [i for i, _ in batch], done.token_ids))
        tokens = sum(len(ids) for ids in done.token_ids)
        rows.append(level_row(level, tokens, wall, [wall] * len(batch), differ))
    return rows


class FaultDrill:
    """Kill the drafter and restart the verifier of `stack` while requests run (`__call__`);
    `done` says what happened, `error` what went wrong."""

    def __init__(self, stack, timeout_s: float = 600.0):
        self.stack = stack
        self.timeout_s = timeout_s
        self.done: list[str] = []
        self.error: str | None = None

    def __call__(self) -> None:
        try:
            drafter = self.stack.services.get("drafter")
            if drafter is not None:
                drafter.kill()
                self.done.append("drafter killed")
            self.stack.restart("verifier").wait_healthy(self.timeout_s)
            self.done.append("verifier killed and restarted")
            if drafter is not None:
                self.stack.restart("drafter").wait_healthy(self.timeout_s)
                self.done.append("drafter restarted")
        except Exception as exc:  # noqa: BLE001 - reported in the level's row
            self.error = f"{type(exc).__name__}: {exc}"

    def summary(self) -> str:
        done = ", ".join(self.done) or "no fault (the first requests never all ran at once)"
        return done + (f"; {self.error}" if self.error else "")


def services(
    client, request_of, prompts: list[list[int]], levels: list[int], args, drill=None,
    compare: bool = True, compare_faulted: bool = True, cpu_of=None, explain=None,
    rows: list[dict] | None = None,
) -> list[dict]:  # fmt: skip
    """Each level's row. With `drill` (a FaultDrill) the last level runs again, the drill
    starting once every client's first request has its first tokens, and each output is
    compared with the same request's output in the clean run. compare (compare_faulted)
    False: outputs that may rightly differ are not compared (sampled ones whose draws follow
    the rounds; a reopened sampled session is reseeded, coordinator/failover.py). cpu_of:
    each service's CPU seconds so far (`Stack.cpu_seconds`), for the cores each used in a
    clean level: on a shared host, a drafter's and a coordinator's CPU is the verifier's
    loss. explain(prompt index, solo output, difference): why an output differs
    (`explain_difference`), kept with each difference in the row. rows: the list the rows
    are appended to as each level ends (returned), so a caller keeps those measured before a
    failure."""
    rows = [] if rows is None else rows
    solo: dict = {}
    runs = [(level, None) for level in levels]
    if drill is not None:
        runs.append((levels[-1], drill))
    outputs: list = []
    for level, faulted in runs:
        batch = _level_prompts(prompts, level, args.concurrency_requests)
        if faulted is not None:  # request by request against the clean run of this level
            solo = {n: out for n, out in enumerate(outputs) if out is not None}
            batch = [(n, ids) for n, (_, ids) in enumerate(batch)]
        cpu_before = cpu_of() if cpu_of is not None and faulted is None else None
        start = time.perf_counter()
        outputs, latencies, failed, stats = _clients(client, request_of, batch, level, faulted)
        wall = time.perf_counter() - start
        cpu_after = cpu_of() if cpu_before is not None else {}
        finished = [(i, out) for (i, _), out in zip(batch, outputs, strict=True) if out is not None]
        differences = None
        if compare_faulted if faulted is not None else compare:
            differences = _differences(solo, [i for i, _ in finished], [out for _, out in finished])
        tokens = sum(len(out) for _, out in finished)
        differ = None if differences is None else len(differences)
        row = level_row(level, tokens, wall, latencies, differ, failed, stats)
        if differences:
            for d in differences:
                key = d["prompt"]  # the faulted run's are keyed by request, not prompt
                if faulted is not None:
                    d["request"], d["prompt"] = key, key % len(prompts)
                if explain is not None:
                    d.update(explain(d["prompt"], solo[key], d))
            row["differences"] = differences
        if faulted is not None:
            row["faults"] = faulted.summary()
        if cpu_before is not None and wall > 0:
            row["cpu_cores"] = {
                name: (cpu_after[name] - used) / wall
                for name, used in cpu_before.items()
                if name in cpu_after
            }
        rows.append(row)
    return rows


def _clients(client, request_of, batch, level: int, drill=None):
    """`level` clients at once, client j sending requests j, j + level, ... in turn: each
    request's output ids (in batch order; None where it failed), every finished request's
    latency, how many failed, and the finished requests' stats. `drill` runs once the first
    `level` requests all stream."""
    outputs: list[list[int] | None] = [None] * len(batch)
    latencies: list[float] = []
    stats: list = []  # each finished request's GenerateStats
    failures: list[str] = []
    started: set[int] = set()
    lock = threading.Lock()
    drill_thread = threading.Thread(target=drill or (lambda: None), daemon=True)

    def one_client(first: int) -> None:
        for n in range(first, len(batch), level):
            start = time.perf_counter()
            ids: list[int] = []
            try:
                for message in client.stream(request_of(batch[n][1])):
                    ids.extend(message.token_ids)
                    if message.finish_reason:
                        stats.append(message.stats)
                    if ids and n < level and n not in started:
                        with lock:
                            started.add(n)
                            if drill is not None and len(started) == min(level, len(batch)):
                                drill_thread.start()
            except grpc.RpcError as exc:
                failures.append(f"request {n}: {_describe(exc)}")
                continue
            outputs[n] = ids
            latencies.append(time.perf_counter() - start)

    with ThreadPoolExecutor(level) as pool:
        list(pool.map(one_client, range(level)))
    if drill_thread.ident is not None:  # started
        drill_thread.join()
    for line in failures:
        print(f"concurrency: {line}", file=sys.stderr)
    return outputs, latencies, len(failures), stats


def _level_prompts(prompts, level: int, per_client: int) -> list[tuple[int, list[int]]]:
    """(prompt index, ids) for level * per_client requests, the prompts taken in turn."""
    return [(i % len(prompts), prompts[i % len(prompts)]) for i in range(level * per_client)]


def _differences(solo: dict, indices, outputs) -> list[dict]:
    """Outputs unlike the same prompt's at the first level (which sets them): the prompt, the
    first position that differs, and the token each run chose there."""
    found = []
    for index, ids in zip(indices, outputs, strict=True):
        ids = list(ids)
        if index not in solo:
            solo[index] = ids
            continue
        position = leading_matches(solo[index], ids)
        if position < max(len(ids), len(solo[index])):
            found.append({
                "prompt": index,
                "position": position,
                "solo_token": _at(solo[index], position),
                "token": _at(ids, position),
            })  # fmt: skip
    return found


def _at(ids: list[int], position: int) -> int | None:
    return ids[position] if position < len(ids) else None  # None: this run ended there


def explain_difference(model, prompt_ids, solo_ids, difference: dict, temperature: float) -> dict:
    """Why an output may rightly differ from its solo run, from plain mlx-lm's logits after
    the common prefix. Greedy: the top two logits' margin (a flip at a margin near the
    dtype's rounding is a tie the batched sums broke the other way). Sampled: the target's
    probability strictly between the two tokens in vocabulary order, the order of the running
    sum a draw searches: 0 means they are neighbours there, so a uniform draw at their
    boundary picks either as the sums round; a real mass between them is no rounding."""
    import mlx.core as mx
    import numpy as np

    position = difference["position"]
    if temperature == 0:
        return logit_rounding(model, list(prompt_ids), list(solo_ids), position)
    from verifier_svc.sampling import SamplingConfig, target_distribution  # the bench's tooling

    logits = model(mx.array([*prompt_ids, *solo_ids[:position]])[None])[0, -1]
    p = target_distribution(np.array(logits.astype(mx.float32)), SamplingConfig(temperature))
    pair = [difference["solo_token"], difference["token"]]
    if None in pair:
        return {"mass_between": None}
    low, high = sorted(pair)
    return {
        "mass_between": float(p[low + 1 : high].sum()),
        "draw_probs": [float(p[t]) for t in pair],
    }


def _explained(rows_of_differences: list[dict]) -> str:
    """The table's note on a level's differences: the largest greedy margin, or the largest
    sampled mass between the two draws."""
    margins = [d["logit_margin"] for d in rows_of_differences if "logit_margin" in d]
    between = [d["mass_between"] for d in rows_of_differences
               if d.get("mass_between") is not None]  # fmt: skip
    if margins:
        return f" (top-2 margins <= {max(margins):.1e})"
    if between:
        return f" (mass between the draws <= {max(between):.1e})"
    return ""


def run_concurrency(
    args, target, drafters: list[str], prompts, log_dir: Path
) -> tuple[dict, list[str]]:
    """Every level for mlx-lm's batched generation and each drafter's stack, and why each
    stack that did not start or stopped failed: the others still run, and a stack that
    stops keeps the levels it finished, so no measured level is lost."""
    from coordinator.bench import StackDidNotStart, running_stack

    levels = parse_levels(args.concurrency)

    def explain(index: int, solo_ids, difference: dict) -> dict:
        return explain_difference(target.model, prompts[index], solo_ids, difference,
                                  args.temperature)  # fmt: skip

    results = {MLX_LM_BATCHED: mlx_lm_batched(target, prompts, levels, args)}
    _print_rows(MLX_LM_BATCHED, results[MLX_LM_BATCHED])
    failed = []
    runs = len(levels) + bool(args.concurrency_faults)  # the drill runs the last level again
    for d, label in zip(drafters, run_labels(drafters), strict=True):
        rows: list[dict] = []  # filled level by level: a stack that fails later keeps them
        try:
            logs = log_dir / f"concurrency-{label.replace(' #', '-')}"
            with running_stack(args, d, logs, label) as stack:
                _stack_levels(stack, d, prompts, levels, args, explain, rows)
        except StackDidNotStart as exc:
            failed.append(str(exc))
            print(f"specd: bench: {exc}", file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - the levels measured before it are kept
            failed.append(f"the {label} stack stopped after {len(rows)} of {runs} levels: "
                          f"{_describe(exc)}")  # fmt: skip
            print(f"specd: bench: {failed[-1]}", file=sys.stderr)
        if rows:
            results[label] = rows
            _print_rows(label, rows)
    return results, failed


def run_labels(drafters: list[str]) -> list[str]:
    """Each stack's name in the results: its drafter, "#2", "#3" after a drafter named again
    (stacks run one after another, so a drafter run twice shows the order's effect)."""
    seen: dict[str, int] = {}
    labels = []
    for d in drafters:
        seen[d] = seen.get(d, 0) + 1
        labels.append(d if seen[d] == 1 else f"{d} #{seen[d]}")
    return labels


def _describe(exc: Exception) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name} {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


def _stack_levels(stack, d: str, prompts, levels, args, explain, rows: list[dict]) -> None:
    """Each level's row for drafter `d`'s running stack, appended to `rows` as measured."""
    from coordinator.bench import bench_request
    from specd.client import CoordinatorClient

    client = CoordinatorClient(stack.coordinator)
    client.generate(bench_request(prompts[0], args, d))  # the first request aside
    drill = FaultDrill(stack) if args.concurrency_faults else None

    def request_of(ids):
        return bench_request(ids, args, d, prompt_seed(ids) if args.temperature else None)

    # a sampled output depends on how its tokens were split into rounds, which drafting and
    # the load decide: comparable with drafting off alone
    compare = args.temperature == 0 or d == "none"
    try:
        services(client, request_of, prompts, levels, args, drill, compare,
                 compare_faulted=args.temperature == 0, cpu_of=stack.cpu_seconds,
                 explain=explain, rows=rows)  # fmt: skip
    finally:
        client.close()


def prompt_seed(prompt_ids: list[int]) -> int:
    """A sampled request's seed, made from its prompt: the same at every level and run."""
    digest = hashlib.blake2b(str(list(prompt_ids)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _print_rows(name: str, rows: list[dict]) -> None:
    print(f"{name}: clients  requests  aggregate tok/s  p50 s  p99 s  differing from solo  "
          "failed", file=sys.stderr)  # fmt: skip
    for r in rows:
        faults = f"  ({r['faults']})" if r.get("faults") else ""
        cores = r.get("cpu_cores")
        cpu = (", CPU cores " + " ".join(f"{name} {used:.2f}" for name, used in cores.items())
               if cores else "")  # fmt: skip
        drafting = (f"  drafted/token {r['drafted_per_token']:.2f}, tau {r['tau']:.2f}, "
                    f"calls/token verifier {r['verify_calls_per_token']:.2f} "
                    f"drafter {r['draft_calls_per_token']:.2f}, "
                    f"sessions/forward {r['forward_sessions']:.1f}"
                    if "tau" in r else "")  # fmt: skip
        print(f"  {r['clients']:>5} {r['requests']:>9} {r['aggregate_tok_s']:16.1f} "
              f"{_seconds(r['p50_s']):>6} {_seconds(r['p99_s']):>6}  "
              f"{_count(r['outputs_differing_from_solo']):>19}  "
              f"{r['failed']:>6}{drafting}{cpu}{faults}"
              f"{_explained(r.get('differences', []))}", file=sys.stderr)  # fmt: skip


def _seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def _count(value: int | None) -> str:
    return "–" if value is None else str(value)


def write_concurrency(path: Path, results: dict[str, list[dict]], notes: list[str] = ()) -> None:
    """JSON of every level, a markdown table (with `notes` under it: the host, stacks that
    did not start) and a chart of aggregate tok/s and p99 latency."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    below = "".join(f"\n{note}\n" for note in notes)
    path.with_suffix(".md").write_text(concurrency_table(results) + "\n" + below)
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
        p99 = [float("nan") if r["p99_s"] is None else r["p99_s"] for r in rows]
        axes[1].plot(clients, p99, marker="o", label=name)
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
        "| runner | clients | aggregate tok/s | vs mlx-lm batched | p50 s | p99 s | differing "
        "| failed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    plain = {r["clients"]: r["aggregate_tok_s"] for r in results.get(MLX_LM_BATCHED, [])}
    for name, rows in results.items():
        for r in rows:
            base = plain.get(r["clients"])
            ratio = f"{r['aggregate_tok_s'] / base:.2f}×" if base else "–"
            faults = f" ({r['faults']})" if r.get("faults") else ""
            lines.append(
                f"| {name} | {r['clients']}{faults} | {r['aggregate_tok_s']:.1f} | {ratio} | "
                f"{_seconds(r['p50_s'])} | {_seconds(r['p99_s'])} | "
                f"{_count(r['outputs_differing_from_solo'])}"
                f"{_explained(r.get('differences', []))} | "
                f"{r.get('failed', 0)} |"
            )
    return "\n".join(lines)
