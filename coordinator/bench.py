"""`specd bench` and `specd demo`: speculation through the three services vs plain mlx-lm,
same model, same dtype, same prompts, in one run."""

from __future__ import annotations

import json
import math
import re
import shlex
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.config import CoordinatorConfig
from coordinator.rounds import leading_matches
from specd.argtypes import int_between, non_negative_int, positive_float, positive_int
from specd.platform import host_description

MODEL_DRAFTERS = ("eagle3", "dflash")  # drafters that run a model and load its weights

# --drafter names -> drafter kind; "-tree" variants draft trees, the others chains; "-mlx" and
# "-host" variants run the head in MLX or on the host (--head-forwards); dflash-bN drafts blocks
# of N; the suffixes a name may carry after these are read by parse_drafter_name
BENCH_DRAFTERS = {"ngram": "ngram", "eagle3": "eagle3", "eagle3-tree": "eagle3",
                  "eagle3-mlx": "eagle3", "eagle3-tree-mlx": "eagle3",
                  "eagle3-host": "eagle3", "eagle3-tree-host": "eagle3",
                  "dflash": "dflash", "dflash-tree": "dflash", "none": None}  # fmt: skip


# a -tree variant's drafts when --tree-total-tokens is not given: a verify of 16 tokens (a
# 17th pads the CPU kernels' products to 20 rows), as many as a DFlash block of 16 verifies
TREE_TOKENS = 15

# runs of the first request right after it, beside the main loop's, for its "later" figure
FIRST_REQUEST_AGAIN = 2

# the suffixes in the one order they may come; the lazy variant leaves each to its own group
_DRAFTER_NAME = re.compile(
    r"(?P<variant>.+?)(?:-p(?P<p_min>[0-9]{2}))?(?P<uncut>-uncut)?"
    r"(?:-burst(?P<burst>[1-9][0-9]*))?"
    r"(?P<nolimit>-nolimit)?(?P<serial>-serial)?(?P<overlap>-overlap)?(?:-k(?P<k>[0-9]+))?"
)
_DFLASH_BLOCKS = re.compile(r"dflash-b[0-9]+")
# -pNN is a chain's --draft-p-min (EAGLE-3 only) or a tree's --tree-min-prob
_P_MIN_VARIANTS = ("eagle3", "eagle3-mlx", "eagle3-host", "eagle3-tree", "eagle3-tree-mlx",
                   "eagle3-tree-host", "dflash-tree")  # fmt: skip
_TREE_VARIANTS = ("eagle3-tree", "eagle3-tree-mlx", "eagle3-tree-host", "dflash-tree")


@dataclass(frozen=True)
class BenchDrafter:
    """One --drafter name, read by parse_drafter_name."""

    name: str  # as given: the label of its results
    variant: str  # the name without its suffixes: "eagle3-mlx", "dflash-b8"
    drafter: str | None  # the drafter service's kind; None: drafting off
    p_min: float | None = None  # -pNN: --draft-p-min NN % (chains), --tree-min-prob (trees)
    uncut: bool = False  # -uncut: the coordinator's --no-priced-tree-cut (trees)
    burst: int | None = None  # -burstN: the stack's --decode-burst; None: the bench's own
    nolimit: bool = False  # -nolimit: --draft-max-requests 0, drafting under any load
    serial: bool = False  # -serial: --no-draft-beside-decode
    overlap: bool = False  # -overlap: --overlap-drafting
    pinned_k: int | None = None  # -kN: every request drafts k = N, adaptive k off


def parse_drafter_name(name: str) -> BenchDrafter:
    """DRAFTER[-pNN][-uncut][-burstN][-nolimit][-serial][-overlap][-kN], in that order:
    "eagle3-mlx-p50-burst8-serial-k2". ValueError for a name that is not one."""
    match = _DRAFTER_NAME.fullmatch(name)
    variant = match["variant"] if match else ""
    dflash_blocks = _DFLASH_BLOCKS.fullmatch(variant) is not None
    k = int(match["k"]) if match and match["k"] else None
    if (
        not (dflash_blocks or variant in BENCH_DRAFTERS)
        or (match["p_min"] and variant not in _P_MIN_VARIANTS)
        or (match["uncut"] and variant not in _TREE_VARIANTS)
        or (k is not None and (k == 0 or variant == "none"))  # no drafts to pin k of
        or (match["overlap"] and variant == "none")  # no drafts to draft ahead of
    ):
        raise ValueError(
            f"unknown drafter {name!r}: want DRAFTER[-pNN][-uncut][-burstN][-nolimit][-serial]"
            "[-overlap][-kN], "
            f"DRAFTER one of {', '.join(BENCH_DRAFTERS)} or dflash-bN"
        )
    return BenchDrafter(
        name=name,
        variant=variant,
        drafter="dflash" if dflash_blocks else BENCH_DRAFTERS[variant],
        p_min=int(match["p_min"]) / 100 if match["p_min"] else None,
        uncut=bool(match["uncut"]),
        burst=int(match["burst"]) if match["burst"] else None,
        nolimit=bool(match["nolimit"]),
        serial=bool(match["serial"]),
        overlap=bool(match["overlap"]),
        pinned_k=k,
    )


def add_bench_args(p) -> None:
    p.add_argument(
        "--questions",
        required=True,
        help="MT-bench-format .jsonl, or mt-bench, humaneval, input-grounded",
    )
    p.add_argument(
        "--drafter",
        default="ngram",
        help="comma-separated: ngram, eagle3 (chains), eagle3-tree, a -mlx or -host suffix "
        "to either (the head's forwards in MLX or on the host: --head-forwards), dflash, "
        "dflash-bN (blocks of N), dflash-tree (trees from a block), "
        "a -pNN suffix to an EAGLE-3 chain name (eagle3-host-p50) to end chains before a "
        "draft the head gives under NN %% (--draft-p-min), or to a tree name (eagle3-tree-p10, "
        "dflash-tree-p10) to send no tree node of a path probability under NN %% "
        "(--tree-min-prob), an -uncut suffix after those to a tree name (eagle3-tree-p20-uncut) "
        "to verify trees whole, not cut at the verifier's prices (--no-priced-tree-cut), "
        "none (the services without drafting: what the split costs); a -serial suffix "
        "(ngram-serial) makes every draft call before its verify (--no-draft-beside-decode); "
        "a -nolimit suffix before it (ngram-nolimit) drafts under any load "
        "(--draft-max-requests 0); an -overlap suffix after those (eagle3-overlap-k1) drafts "
        "the next block while the verify runs (--overlap-drafting, as --overlap for every "
        "stack); "
        "a -burstN suffix before those (none-burst16) sets that stack's --decode-burst; "
        "a -kN suffix (eagle3-k2) drafts k = N every round, adaptive k off; all run side by "
        "side",
    )
    p.add_argument("--max-tokens", type=int_between(1), default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--target", help="model (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--gemv-rows",
        type=int_between(0),
        metavar="N",
        help="the verifier's --gemv-rows (default: its own); plain mlx-lm is never changed",
    )
    p.add_argument(
        "--float32-weights",
        action="store_true",
        help="the verifier's --float32-weights (and the in-process loop's)",
    )
    p.add_argument(
        "--verifier-args",
        default="",
        metavar="FLAGS",
        help="more flags for every stack's verifier, as one string "
        '(e.g. "--look-ahead off --row-forwards off")',
    )
    p.add_argument("--limit", type=int_between(1), help="first N questions only")
    p.add_argument("--categories", help="comma-separated categories to keep")
    p.add_argument(
        "--every", type=int_between(1), default=1, help="keep every N-th question (spread sample)"
    )
    p.add_argument(
        "--num-draft-tokens", type=int, help="the drafter's k (the most k when adaptive)"
    )
    p.add_argument("--ngram-min-n", type=int_between(1))
    p.add_argument("--ngram-max-n", type=int_between(1))
    p.add_argument("--weights", type=Path, help="eagle3 head (default: the shipped one)")
    p.add_argument(
        "--tree-total-tokens",
        type=int_between(0),
        help="eagle3-tree, dflash-tree: tokens per tree (15: a verify of 16 tokens, as a DFlash "
        "block of 16's)",
    )
    p.add_argument(
        "--tree-depth",
        type=int_between(1),
        help="-tree drafters: deepest path (eagle3 5, dflash its block's drafts)",
    )
    p.add_argument(
        "--tree-top-k", type=int_between(1), help="-tree drafters: children a node (4; dflash 8)"
    )
    p.add_argument(
        "--drafter-blas-threads",
        type=non_negative_int,
        help="each drafter's --blas-threads (default: its own, 1)",
    )
    p.add_argument(
        "--no-adaptive",
        dest="adaptive",
        action="store_false",
        help="draft a fixed k every round instead of adapting it",
    )
    p.add_argument(
        "--decode-burst",
        type=positive_int,
        default=CoordinatorConfig.decode_burst,
        help="tokens per verifier call when no drafts are wanted (coordinator --decode-burst)",
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="coordinators draft the next block while verifying (--overlap-drafting)",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="also run the round loop in this process (no gRPC) for comparison",
    )
    p.add_argument(
        "--repeat",
        type=int_between(1),
        default=1,
        help="run every question this many times in each mode, in turn, and keep each mode's "
        "fastest run: a shared host's slow spells only add time (greedy output must match "
        "every time)",
    )
    p.add_argument(
        "--time-limit",
        type=positive_float,
        metavar="SECONDS",
        help="start no new question after this long (services' start-up included) and report "
        "the questions done: on a machine lent for a while, a partial table beats none",
    )
    p.add_argument(
        "--concurrency",
        metavar="LEVELS",
        help="comma-separated client counts (e.g. 1,4,16): aggregate tok/s and request latency "
        "of each drafter's stack under that many clients at once, beside mlx-lm's batched plain "
        "generation of the same prompts (instead of the per-question comparison)",
    )
    p.add_argument(
        "--concurrency-requests",
        type=int_between(1),
        default=2,
        metavar="N",
        help="requests each client sends one after the other at every --concurrency level",
    )
    p.add_argument(
        "--concurrency-faults",
        action="store_true",
        help="at the highest --concurrency level, once every client's first request runs, kill "
        "the drafter and kill and restart the verifier (the drafter returns after it), in a "
        "second run of that level; every request must still finish with its first run's output",
    )
    p.add_argument("--json", dest="json_out", type=Path, help="write results here")
    p.add_argument("--log-dir", type=Path, help="service logs (default: a temp dir)")


@dataclass
class Baseline:
    token_ids: list[int]
    seconds: float
    margins: list[float] = field(repr=False)  # per step, the top-2 logprob margin
    first_token_s: float = 0.0  # from the call to the first token: the prompt's prefill


def plain_decode(
    model, prompt_ids, max_tokens: int, eos_ids, temperature: float = 0.0, seed: int | None = None
) -> Baseline:
    """What a user runs without specd: mlx-lm's generate_step."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temperature) if temperature > 0 else None
    if seed is not None:
        mx.random.seed(seed)
    ids, logprobs = [], []
    start = time.perf_counter()
    first = 0.0
    for token, lp in generate_step(
        mx.array(prompt_ids), model, max_tokens=max_tokens, sampler=sampler
    ):
        first = first or time.perf_counter() - start
        ids.append(token)
        logprobs.append(lp)
        if token in eos_ids:
            break
    seconds = time.perf_counter() - start
    return Baseline(ids, seconds, step_margins(logprobs), first)


def step_margins(logprobs: list) -> list[float]:
    """Top-2 margin of each step's logprobs (kept to explain a difference), computed after
    the timed decode in one evaluation."""
    import mlx.core as mx

    if not logprobs:
        return []
    top = mx.topk(mx.stack(logprobs).astype(mx.float32), 2, axis=-1).tolist()
    return [abs(a - b) for a, b in top]


def logit_rounding(model, prompt_ids: list[int], tokens: list[int], position: int) -> dict:
    """At the first differing position: the baseline's top two logits, their margin, and the
    spacing of the compute dtype at that magnitude (its rounding there). A flip whose margin is
    within a few such steps is a tie the dtype cannot break the same way twice."""
    import mlx.core as mx
    import numpy as np

    logits = model(mx.array(prompt_ids + tokens[:position])[None])[0, -1]
    top = mx.topk(logits, 2)
    values = sorted(top.astype(mx.float32).tolist(), reverse=True)
    dtype = {mx.float16: np.float16, mx.bfloat16: None, mx.float32: np.float32}.get(logits.dtype)
    if dtype is None:  # bfloat16: float32's exponent, 8 bits of mantissa
        spacing = float(np.spacing(np.float32(values[0]))) * 2**16
    else:
        spacing = float(np.spacing(dtype(values[0])))
    return {
        "top_logits": values,
        "logit_margin": values[0] - values[1],
        "logit_dtype": str(logits.dtype).removeprefix("mlx.core."),
        "rounding": abs(spacing),
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    same = leading_matches(a, b)
    return None if same == len(a) == len(b) else same


def summarize(rows: list[dict]) -> dict:
    base = sum(r["baseline_s"] for r in rows)
    spec = sum(r["spec_s"] for r in rows)
    rounds = sum(r["rounds"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    split = {
        k: 1000 * sum(r[k] for r in rows) / max(rounds, 1)
        for k in ("draft_s", "verify_s", "coordinator_s", "draft_compute_s", "verify_compute_s")
    }
    return {
        "speedup": base / spec if spec else 0.0,
        "tau": 1 + accepted / rounds if rounds else 0.0,
        # token identity is only defined for greedy decoding
        "identical": None
        if any(r["identical"] is None for r in rows)
        else sum(r["identical"] for r in rows),
        "count": len(rows),
        "baseline_tok_s": sum(r["baseline_tokens"] for r in rows) / base if base else 0.0,
        "spec_tok_s": sum(r["tokens"] for r in rows) / spec if spec else 0.0,
        "round_split_ms": {k.removesuffix("_s"): round(v, 2) for k, v in split.items()},
        # the prompt: the services' prefill (the coordinator's clock) against plain mlx-lm's
        # time to its first token, median question
        "prefill_median_ms": round(1000 * statistics.median(r["prefill_s"] for r in rows), 2)
        if rows
        else 0.0,
        "baseline_first_token_median_ms": round(
            1000 * statistics.median(r.get("baseline_first_token_s", 0.0) for r in rows), 2
        )
        if rows
        else 0.0,
        # the median question's median round: time outside the two services' compute
        "round_outside_median_ms": round(
            1000 * statistics.median(r["round_overhead_median_s"] for r in rows), 2
        )
        if rows
        else 0.0,
        # in-process seconds / split seconds: what the three processes cost, 1.0 = nothing
        "split_vs_inprocess": (
            sum(r["inproc_s"] for r in rows) / spec
            if rows and "inproc_s" in rows[0] and spec
            else None
        ),
        # the same for the target's forwards alone: below 1.0, they run slower in the service
        "compute_split_vs_inprocess": (
            sum(r["inproc_verify_compute_s"] for r in rows)
            / sum(r["verify_compute_s"] for r in rows)
            if rows and "inproc_verify_compute_s" in rows[0]
            else None
        ),
        # per question, then the median: one question caught by a slow spell of a shared host
        # moves the sums above but not these
        "speedup_median": _median_ratio(rows, "baseline_s", "spec_s"),
        "split_vs_inprocess_median": (
            _median_ratio(rows, "inproc_s", "spec_s") if rows and "inproc_s" in rows[0] else None
        ),
    }


def _median_ratio(rows: list[dict], numerator: str, denominator: str) -> float:
    ratios = [r[numerator] / r[denominator] for r in rows if r[denominator]]
    return statistics.median(ratios) if ratios else 0.0


def service_memory(client) -> dict:
    info = client.info()
    out = {
        "coordinator": info.process.peak_rss_bytes,
        "verifier": info.verifier.process.peak_rss_bytes,
    }
    if info.HasField("drafter"):
        out["drafter"] = info.drafter.process.peak_rss_bytes
    return out


def _known(name: str) -> bool:
    try:
        parse_drafter_name(name)
    except ValueError:
        return False
    return True


def _variant_options(args, name: str) -> dict:
    """Options of bench drafter `name` as `specd serve drafter` flags take them."""
    parsed = parse_drafter_name(name)
    variant = parsed.variant  # no pinned k here: the request carries it (bench_request)
    tree = "-tree" in variant
    return {
        "num_draft_tokens": args.num_draft_tokens,
        "ngram_min_n": args.ngram_min_n,
        "ngram_max_n": args.ngram_max_n,
        "weights": args.weights,
        # chains are forced for the plain variant whatever the head's default shape
        "tree_total_tokens": (args.tree_total_tokens or TREE_TOKENS) if tree else 0,
        "tree_depth": args.tree_depth if tree else None,
        "tree_top_k": args.tree_top_k if tree else None,
        "block_size": int(variant[len("dflash-b") :]) if variant.startswith("dflash-b") else None,
        "head_forwards": (
            variant.rpartition("-")[2] if variant.endswith(("-mlx", "-host")) else None
        ),
        "draft_p_min": None if tree else parsed.p_min,
        "tree_min_prob": parsed.p_min if tree else None,
    }


_KIND_OPTIONS = {
    "ngram": ("num_draft_tokens", "ngram_min_n", "ngram_max_n"),
    "eagle3": (
        "num_draft_tokens",
        "weights",
        "tree_total_tokens",
        "tree_depth",
        "tree_top_k",
        "head_forwards",
        "draft_p_min",
        "tree_min_prob",
    ),  # fmt: skip
    "dflash": (
        "weights",
        "block_size",
        "tree_total_tokens",
        "tree_depth",
        "tree_top_k",
        "tree_min_prob",
    ),  # fmt: skip
}


def _drafter_args(args, name: str) -> list[str]:
    options = _variant_options(args, name)
    out = []
    if args.drafter_blas_threads is not None:
        out += ["--blas-threads", str(args.drafter_blas_threads)]
    for option in _KIND_OPTIONS.get(parse_drafter_name(name).drafter, ()):
        flag = "--" + option.replace("_", "-")
        if options[option] is True:  # a switch
            out.append(flag)
        elif options[option] is not None:
            out += [flag, str(options[option])]
    return out


def in_process_runner(args, name: str):
    """The same round loop with no gRPC (coordinator/local.py), for the cost of the split."""
    import asyncio

    from coordinator.adaptive import AdaptiveK, SpeculationCosts, TreeLimits
    from coordinator.local import LocalDrafter, LocalVerifier
    from coordinator.rounds import Plan, RoundStats, run_rounds
    from drafter_svc.config import DrafterConfig, drafter_options
    from drafter_svc.server import make_proposer
    from specd.v1 import common_pb2
    from verifier_svc.servicer import target_for

    # its own copy of the model (the baseline's stays free of the capture wrappers), served as
    # the stack's verifier serves it: on a GPU row by row, where its own forward would be dearer
    verifier = LocalVerifier(target_for(verifier_config(args, name)))
    parsed = parse_drafter_name(name)
    drafter = None
    if parsed.drafter is not None:
        options = drafter_options(parsed.drafter, **_variant_options(args, name))
        proposer = make_proposer(DrafterConfig(**options, target=args.target))
        drafter = LocalDrafter(proposer)
    costs = SpeculationCosts()

    async def consume(prompt_ids, plan, stats):
        async for _ in run_rounds(verifier, drafter, prompt_ids, plan, stats):
            pass

    def run(prompt_ids) -> tuple[float, RoundStats]:
        k = (parsed.pinned_k or drafter.proposer.default_draft_tokens) if drafter else 0
        adaptive = None
        if args.adaptive and parsed.pinned_k is None and k:
            tree = TreeLimits.of(getattr(drafter.proposer, "default_tree", None))
            text_driven = drafter.proposer.text_driven
            adaptive = AdaptiveK.for_session(costs, k, text_driven=text_driven, tree=tree)
        shape = getattr(drafter.proposer, "default_tree", None) if drafter else None
        cut = k and not parsed.uncut and TreeLimits.of(shape) is not None  # as the services
        plan = Plan(
            args.max_tokens,
            k,
            common_pb2.SamplingParams(temperature=args.temperature),
            adaptive,
            decode_burst=parsed.burst or args.decode_burst,
            # as the services: a tree drafter's guess is never matched beside a burst
            draft_beside_decode=not parsed.serial and TreeLimits.of(shape) is None,
            tree_prices=costs.verify if cut else None,
        )
        stats = RoundStats()
        start = time.perf_counter()
        asyncio.run(consume(prompt_ids, plan, stats))
        return time.perf_counter() - start, stats

    return run


def verifier_config(args, name: str):
    """The settings of the verifier that drafter `name`'s stack starts, read from its flags as
    `specd serve verifier` reads them."""
    from specd.cli import service_config

    return service_config("verifier", bench_stack(args, name, None).verifier_flags())


def _spec_row(question, base: Baseline, spec, spec_s: float, temperature: float) -> dict:
    s = spec.stats
    row = {
        "question_id": question.question_id,
        "category": question.category,
        "tokens": len(spec.token_ids),
        "baseline_tokens": len(base.token_ids),
        "baseline_s": base.seconds,
        "baseline_first_token_s": base.first_token_s,
        "spec_s": spec_s,
        "tau": s["tau"],
        "identical": spec.token_ids == base.token_ids if temperature == 0 else None,
        **{
            k: s[k]
            for k in (
                "rounds",
                "drafted",
                "accepted",
                "draft_s",
                "verify_s",
                "coordinator_s",
                "prefill_s",
                "draft_compute_s",
                "verify_compute_s",
                "round_overhead_median_s",
                "draft_calls",
                "beside_calls",
                "predrafted_rounds",
            )
        },
    }
    if temperature == 0 and not row["identical"]:
        pos = first_difference(spec.token_ids, base.token_ids)
        row["first_difference"] = pos
        if pos is not None and pos < len(base.margins):
            row["baseline_margin"] = base.margins[pos]
    return row


def _fastest_row(question, base: Baseline, tries: list, temperature: float) -> dict:
    """One question's row from its repeats: the fastest split run, the fastest in-process
    run (per token: sampled runs differ in length); greedy output counts as identical only if
    every repeat was."""
    spec, seconds, _ = min(tries, key=lambda t: t[1] / max(1, len(t[0].token_ids)))
    row = _spec_row(question, base, spec, seconds, temperature)
    differing = next((t[0] for t in tries if t[0].token_ids != base.token_ids), None)
    if temperature == 0 and row["identical"] and differing is not None:
        row["identical"] = False
        row["first_difference"] = first_difference(differing.token_ids, base.token_ids)
    if tries[0][2] is not None:
        inproc_s, inproc = min(
            (t[2] for t in tries), key=lambda t: t[0] / max(1, t[1].generated_tokens)
        )
        row["inproc_s"] = inproc_s
        row["inproc_round_ms"] = 1000 * inproc.total_s / max(inproc.rounds, 1)
        row["inproc_prefill_s"] = inproc.prefill_s
        row["inproc_verify_compute_s"] = inproc.verify_compute_s
        row["inproc_draft_s"] = inproc.draft_s
    return row


def chat_prompts(tokenizer, questions) -> list[list[int]]:
    from specd.prompts import encode_chat

    return [encode_chat(tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in questions]


def announce(args, name: str, dtype_timings: dict, drafters, count: int, log_dir: Path) -> None:
    if dtype_timings:
        timed = ", ".join(f"{d} {ms:.2f} ms" for d, ms in dtype_timings.items())
        print(f"bench: dtype auto chose {args.dtype} ({timed})", file=sys.stderr)
    print(
        f"bench: {count} questions, target {name} ({args.dtype}), drafters "
        f"{', '.join(drafters)}, {args.max_tokens} tokens; logs in {log_dir}",
        file=sys.stderr,
    )
    host = host_description()
    load = " ".join(map(str, host["load"])) if host["load"] else "unknown"
    print(f"bench: host {host['cpu']}, {host['cores']} cores, load {load}", file=sys.stderr)


def run_bench(args) -> int:
    from coordinator.baseline import BaselineProcess, PlainProcessDied
    from specd.datasets import load_questions
    from specd.models.load import load_target

    drafters = [d.strip() for d in args.drafter.split(",") if d.strip()]
    unknown = sorted(d for d in drafters if not _known(d))
    if unknown or not drafters:
        print(
            f"specd: unknown drafter(s) {unknown}; choose from {', '.join(BENCH_DRAFTERS)}",
            file=sys.stderr,
        )
        return 2
    named_twice = sorted({d for d in drafters if drafters.count(d) > 1})
    if named_twice and not args.concurrency:
        print(
            f"specd: bench: {', '.join(named_twice)} named twice in --drafter; each stack runs "
            "once a question beside the others (--repeat N runs each N times)",
            file=sys.stderr,
        )
        return 2
    if args.concurrency_faults and not args.concurrency:
        print("specd: bench: --concurrency-faults needs --concurrency LEVELS", file=sys.stderr)
        return 2
    if args.concurrency:
        from coordinator.concurrency import parse_levels

        try:
            parse_levels(args.concurrency)
        except ValueError as exc:
            print(f"specd: bench: {exc}", file=sys.stderr)
            return 2
    categories = args.categories.split(",") if args.categories else None
    try:
        questions = load_questions(args.questions, limit=args.limit, categories=categories)
    except (ValueError, OSError) as exc:
        print(f"specd: bench: {exc}", file=sys.stderr)
        return 1
    questions = questions[:: args.every]
    if not questions:
        print(
            f"specd: bench: no questions in {args.questions}"
            + (f" of categories {args.categories}" if args.categories else ""),
            file=sys.stderr,
        )
        return 1
    started = time.perf_counter()
    if args.concurrency:  # mlx-lm's batched generation runs in this process
        target = load_target(args.target, args.dtype)
        args.dtype = target.dtype
        prompts = chat_prompts(target.tokenizer, questions)
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="specd-bench-"))
        announce(args, target.identity.name, target.dtype_timings, drafters, len(prompts), log_dir)
        from coordinator.concurrency import concurrency_table, run_concurrency, write_concurrency

        levels, failed = run_concurrency(args, target, drafters, prompts, log_dir)
        print(concurrency_table(levels))
        if args.json_out:
            host = host_description()
            notes = [f"host: {host['cpu']}, {host['cores']} cores", *failed]
            write_concurrency(args.json_out, levels, notes)
        for reason in failed:  # again after the table, so it is not missed
            print(f"specd: bench: {reason}", file=sys.stderr)
        return 1 if failed else 0
    try:
        plain = BaselineProcess(args.target, args.dtype)
    except RuntimeError as exc:
        print(f"specd: bench: {exc}", file=sys.stderr)
        return 1
    with plain:
        try:
            return _bench_against(args, plain, questions, drafters, started)
        except (PlainProcessDied, StackDidNotStart) as exc:
            print(f"specd: bench: {exc}", file=sys.stderr)
            return 1


def _bench_against(args, plain, questions, drafters: list[str], started: float) -> int:
    """The sequential bench: every question through each drafter's stack and through plain
    mlx-lm (`plain`, a BaselineProcess), in turn."""
    from contextlib import ExitStack

    from specd.client import CoordinatorClient
    from specd.launch import spawn_together
    from specd.models.load import load_tokenizer

    target = plain.target
    args.dtype = target.dtype  # auto measured once: every stack and the baseline use its choice
    prompts = chat_prompts(load_tokenizer(args.target), questions)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="specd-bench-"))
    announce(args, target.name, target.dtype_timings, drafters, len(prompts), log_dir)
    rows: dict[str, list[dict]] = {d: [] for d in drafters}
    memory = {}
    with ExitStack() as running:
        clients, in_process, first = {}, {}, {}
        # one stack each, all up (idle ones cost memory, not time). On a GPU a verifier's
        # warm-up takes a minute or more: the first stack, and the first of each further
        # model drafter, warm up alone and fill the kernel cache; the others then warm up side
        # by side, reading it only (MLX writes it unlocked); all are up before any is timed
        stacks = {d: bench_stack(args, d, log_dir / d) for d in drafters}
        for stack in stacks.values():
            running.callback(stack.stop)
        alone = _stacks_started_alone(drafters)
        for d in alone:
            with starting(d):
                stacks[d].start()
        spawn_together([stacks[d] for d in drafters if d not in alone])
        for d in drafters:
            with starting(d):
                clients[d] = CoordinatorClient(stacks[d].wait_healthy().coordinator)
        for d in drafters:
            # the first request after SERVING, timed: the services' warm-up must have compiled
            # every shape it meets; the main loop runs the same request again
            # GPU requests of one prompt vary by a third from run to run: the later figure is
            # a median of the main loop's run and these runs right after the first
            times = []
            for _ in range(1 + FIRST_REQUEST_AGAIN):
                start = time.perf_counter()
                spec = clients[d].generate(bench_request(prompts[0], args, d))
                times.append((time.perf_counter() - start, len(spec.token_ids)))
            first[d] = times
            if args.in_process:
                in_process[d] = in_process_runner(args, d)
                in_process[d](prompts[0][:8])
        plain.decode(prompts[0], 8)
        for i, (question, prompt_ids) in enumerate(zip(questions, prompts, strict=True)):
            if i and args.time_limit and time.perf_counter() - started > args.time_limit:
                print(f"bench: --time-limit {args.time_limit:g} s reached; reporting the "
                      f"{i} of {len(questions)} questions done", file=sys.stderr)  # fmt: skip
                break
            requests = {d: bench_request(prompt_ids, args, d) for d in drafters}
            tries = {d: [] for d in drafters}
            bases = []
            for _ in range(args.repeat):
                bases.append(plain.decode(prompt_ids, args.max_tokens, args.temperature))
                for d in drafters:
                    start = time.perf_counter()
                    spec = clients[d].generate(requests[d])
                    seconds = time.perf_counter() - start
                    inproc = in_process[d](prompt_ids) if d in in_process else None
                    tries[d].append((spec, seconds, inproc))
            base = min(bases, key=lambda b: b.seconds / max(1, len(b.token_ids)))
            if args.temperature == 0 and any(b.token_ids != base.token_ids for b in bases):
                print(f"bench: plain mlx-lm's greedy output varied over the repeats of "
                      f"question {question.question_id}; compared with its fastest run",
                      file=sys.stderr)  # fmt: skip
            line = [f"[{i + 1}/{len(questions)}] {question.category:<12}"]
            for d in drafters:
                row = _fastest_row(question, base, tries[d], args.temperature)
                if row.get("first_difference") is not None:
                    pos = row["first_difference"]
                    if pos < len(base.token_ids):
                        row.update(plain.rounding(prompt_ids, base.token_ids, pos))
                if i == 0:
                    (row["first_request_s"], row["first_request_tokens"]), *again = first[d]
                    row["first_request_again_s"] = [seconds for seconds, _ in again]
                    row["first_request_again_tokens"] = [tokens for _, tokens in again]
                rows[d].append(row)
                same = {None: "", True: "same"}.get(
                    row["identical"], f"DIFF at {row.get('first_difference')}"
                )
                line.append(f"{d} {base.seconds / row['spec_s']:5.2f}x tau {row['tau']:.2f} {same}")
            print("  ".join(line), file=sys.stderr)
        for d in drafters:
            memory[d] = service_memory(clients[d])
            clients[d].close()
    results = {d: _result(args, target, d, rows[d], memory[d], len(questions)) for d in drafters}
    for result in results.values():
        print(format_table(result))
    off = results.get(DRAFTING_OFF)
    for d, result in results.items():
        share = None if off is None or d == DRAFTING_OFF else drafts_share(result, off)
        if share is not None:
            result["overall"]["drafts_share"] = share
            print(f"{d}: drafts' share {share:.2f}x (against drafting off in this run, per "
                  "question, geometric mean)")  # fmt: skip
    if args.json_out:
        write_outputs(args.json_out, results)
    return 0


DRAFTING_OFF = "none"


def drafts_share(result: dict, off: dict) -> float | None:
    """What the drafts add: per question both ran, drafting off's time over the drafter's,
    geometric mean (None without a common question). The engine's part is drafting off's own
    speed-up over plain mlx-lm."""
    off_s = {row["question_id"]: row["spec_s"] for row in off["questions"]}
    ratios = [off_s[row["question_id"]] / row["spec_s"] for row in result["questions"]
              if row["question_id"] in off_s]  # fmt: skip
    if not ratios:
        return None
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def timing_prefills(verifier_args: list[str]) -> list[str]:
    """The verifier's flags with its prefix cache off unless they set it: a bench sends the
    same prompts again (warm-ups, repeats, solo runs beside concurrent ones), and a prompt
    found stored would skip the prefill that plain mlx-lm's side pays."""
    if any(a == "--prefix-cache" or a.startswith("--prefix-cache=") for a in verifier_args):
        return verifier_args
    return [*verifier_args, "--prefix-cache", "0"]


def _stacks_started_alone(drafters: list[str]) -> list[str]:
    """The first stack, and the first of each further drafter kind that runs a model (its
    kernels compiled once, before stacks warm up side by side)."""
    kinds = {parse_drafter_name(drafters[0]).drafter}
    alone = [drafters[0]]
    for d in drafters[1:]:
        kind = parse_drafter_name(d).drafter
        if kind in MODEL_DRAFTERS and kind not in kinds:
            kinds.add(kind)
            alone.append(d)
    return alone


class StackDidNotStart(RuntimeError):
    """A bench stack's services did not come up (e.g. no shipped drafter fits the target)."""


@contextmanager
def starting(drafter: str):
    """Turns a failed start of `drafter`'s stack into one error that names it."""
    try:
        yield
    except (RuntimeError, TimeoutError) as exc:
        raise StackDidNotStart(f"the {drafter} stack did not start: {exc}") from exc


@contextmanager
def running_stack(args, drafter: str, log_dir: Path, name: str | None = None):
    """`bench_stack`'s services, started (StackDidNotStart, naming the stack `name` or its
    drafter, if they do not come up), then stopped on leaving."""
    stack = bench_stack(args, drafter, log_dir)
    with starting(name or drafter):
        stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def bench_stack(args, drafter: str, log_dir: Path):
    """The three services for bench drafter `drafter`, with the bench's options."""
    from specd.launch import Stack

    parsed = parse_drafter_name(drafter)
    return Stack(
        target=args.target,
        drafter=parsed.drafter,
        dtype=args.dtype,
        gemv_rows=args.gemv_rows,
        float32_weights=args.float32_weights,
        verifier_args=timing_prefills(shlex.split(args.verifier_args)),
        drafter_args=_drafter_args(args, drafter),
        coordinator_args=([] if args.adaptive else ["--no-adaptive"])
        + (["--overlap-drafting"] if args.overlap or parsed.overlap else [])
        + ["--decode-burst", str(parsed.burst or args.decode_burst)]
        + (["--no-draft-beside-decode"] if parsed.serial else [])
        + (["--draft-max-requests", "0"] if parsed.nolimit else [])
        + (["--no-priced-tree-cut"] if parsed.uncut else []),
        log_dir=log_dir,
    )


def bench_request(prompt_ids, args, drafter: str, seed: int | None = None):
    from specd.client import make_request

    return make_request(
        prompt_ids=prompt_ids,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=seed,
        # a pinned request turns adaptation off
        num_draft_tokens=parse_drafter_name(drafter).pinned_k,
    )


def first_request_ratio(rows: list[dict]) -> float | None:
    """Seconds per token of the first request after SERVING over the median of the same
    request's later runs: 1.0 = the first client pays nothing for start-up."""
    row = rows[0] if rows else {}
    if "first_request_s" not in row or not row["tokens"] or not row["first_request_tokens"]:
        return None
    first = row["first_request_s"] / row["first_request_tokens"]
    again = zip(
        row.get("first_request_again_s", []), row.get("first_request_again_tokens", []), strict=True
    )
    later = [row["spec_s"] / row["tokens"]] + [s / n for s, n in again if n]
    return first / statistics.median(later)


def _result(args, target, drafter: str, rows: list[dict], memory: dict, asked: int) -> dict:
    parsed = parse_drafter_name(drafter)
    return {
        "questions_asked": asked,  # more than were run when --time-limit stopped the bench
        "first_request_vs_later": first_request_ratio(rows),
        "target": target.name,
        "drafter": drafter,
        "dtype": target.dtype,
        "gemv_rows": args.gemv_rows,  # None: the verifier's default
        "verifier_args": args.verifier_args,
        "max_tokens": args.max_tokens,
        "adaptive": args.adaptive and parsed.pinned_k is None,
        "decode_burst": parsed.burst or args.decode_burst,
        "overlap": args.overlap or parsed.overlap,
        "temperature": args.temperature,
        "repeat": args.repeat,  # times each mode ran each question; rows keep the fastest
        "questions": rows,
        "by_category": {
            c: summarize([r for r in rows if r["category"] == c])
            for c in sorted({r["category"] for r in rows})
        },
        "overall": summarize(rows),
        "peak_rss_bytes": memory,
        "host": host_description(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_outputs(path: Path, results: dict[str, dict]) -> None:
    """JSON per drafter (path itself when there is one), a markdown table, a PNG chart."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for drafter, result in results.items():
        out = path if len(results) == 1 else path.with_name(f"{path.stem}-{drafter}.json")
        out.write_text(json.dumps(result, indent=1))
    path.with_suffix(".md").write_text(markdown_table(results))
    try:
        plot_chart(results, path.with_suffix(".png"))
    except ImportError:
        print("bench: no chart (pip install 'specd[plot]' for matplotlib)", file=sys.stderr)


def markdown_table(results: dict[str, dict]) -> str:
    lines = [
        "| drafter | category | n | speed-up | τ | identical |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for drafter, result in results.items():
        for name, s in [*result["by_category"].items(), ("**overall**", result["overall"])]:
            same = "–" if s["identical"] is None else f"{s['identical']}/{s['count']}"
            lines.append(
                f"| {drafter} | {name} | {s['count']} | {s['speedup']:.2f}× | "
                f"{s['tau']:.2f} | {same} |"
            )
    return "\n".join(lines) + "\n"


def plot_chart(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = sorted({c for r in results.values() for c in r["by_category"]}) + ["overall"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(results)
    for i, (drafter, result) in enumerate(results.items()):
        stats = [
            result["by_category"].get(c, result["overall"]) if c != "overall" else result["overall"]
            for c in categories
        ]
        xs = [x + i * width for x in range(len(categories))]
        axes[0].bar(xs, [s["speedup"] for s in stats], width, label=drafter)
        axes[1].bar(xs, [s["tau"] for s in stats], width, label=drafter)
    for ax, title in zip(
        axes, ("speed-up over plain mlx-lm", "τ (mean acceptance length)"), strict=True
    ):
        ax.set_xticks(
            [x + 0.4 - width / 2 for x in range(len(categories))],
            categories,
            rotation=30,
            ha="right",
        )
        ax.set_title(title)
        ax.legend()
    axes[0].axhline(1.0, color="grey", linewidth=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_table(result: dict) -> str:
    done, asked = len(result["questions"]), result.get("questions_asked", 0)
    lines = [
        f"target {result['target']} ({result['dtype']}), drafter {result['drafter']}, "
        f"{result['max_tokens']} tokens, temperature {result['temperature']}"
        + (f"; {done} of {asked} questions (--time-limit)" if asked > done else ""),
        f"{'category':<16}{'n':>4}{'speedup':>9}{'tau':>7}{'identical':>11}"
        f"{'plain tok/s':>13}{'spec tok/s':>12}",
    ]
    for name, s in [*result["by_category"].items(), ("OVERALL", result["overall"])]:
        same = "-" if s["identical"] is None else f"{s['identical']}/{s['count']}"
        lines.append(
            f"{name:<16}{s['count']:>4}{s['speedup']:>8.2f}x{s['tau']:>7.2f}{same:>11}"
            f"{s['baseline_tok_s']:>13.2f}{s['spec_tok_s']:>12.2f}"
        )
    overall = result["overall"]
    for row in result["questions"]:
        if "logit_margin" in row:
            lines.append(
                f"question {row['question_id']}: differs at token {row['first_difference']}, "
                f"top-2 logit margin {row['logit_margin']:.4g} where {row['logit_dtype']} "
                f"rounds in steps of {row['rounding']:.3g}"
            )
    if result.get("first_request_vs_later") is not None:
        lines.append(
            f"first request after SERVING: {result['first_request_vs_later']:.2f}x the time per "
            "token of the same request later"
        )
    line = f"median question: speed-up {overall['speedup_median']:.2f}x"
    if overall.get("split_vs_inprocess_median"):
        line += f", split vs in-process {overall['split_vs_inprocess_median']:.3f}"
    lines.append(line)
    ratio = overall.get("split_vs_inprocess")
    if ratio:
        lines.append(f"split vs in-process: {ratio:.3f} (1.0 = the three processes cost nothing)")
        compute = result["overall"].get("compute_split_vs_inprocess")
        if compute is not None:
            lines.append(f"  the target's forwards alone: {compute:.3f}")
    split = result["overall"]["round_split_ms"]
    lines.append(
        f"per round: draft {split['draft']:.1f} ms (compute {split['draft_compute']:.1f}), "
        f"verify {split['verify']:.1f} ms (compute {split['verify_compute']:.1f}), "
        f"coordinator {split['coordinator']:.1f} ms; outside the compute, median "
        f"{result['overall']['round_outside_median_ms']:.1f} ms"
    )
    lines.append(
        f"prompt, median question: prefill {overall['prefill_median_ms']:.1f} ms through the "
        f"services, plain mlx-lm's first token {overall['baseline_first_token_median_ms']:.1f} ms"
    )
    return "\n".join(lines)
