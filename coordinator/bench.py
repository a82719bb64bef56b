"""`specd bench` and `specd demo`: speculation through the three services vs plain mlx-lm,
same model, same dtype, same prompts, in one run."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DEMO_PROMPT = (
    "Rewrite the following note so that it is polite and clear, keeping every fact:\n\n"
    "hey team, the server migration is moved to friday 6pm because the database backup "
    "took longer than planned. the old server stays online until sunday. if you have jobs "
    "scheduled on the old server, move them to the new server before friday 6pm. the new "
    "server address is build-02.internal and your old passwords still work. ask maria if "
    "something breaks."
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
        choices=["ngram", "none"],
        help="none: the services without drafting (what the split costs)",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--target", help="model (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--limit", type=int, help="first N questions only")
    p.add_argument("--categories", help="comma-separated categories to keep")
    p.add_argument("--every", type=int, default=1, help="keep every N-th question (spread sample)")
    p.add_argument(
        "--num-draft-tokens", type=int, help="the drafter's k (the most k when adaptive)"
    )
    p.add_argument("--ngram-min-n", type=int)
    p.add_argument("--ngram-max-n", type=int)
    p.add_argument(
        "--no-adaptive",
        dest="adaptive",
        action="store_false",
        help="draft a fixed k every round instead of adapting it",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="also run the round loop in this process (no gRPC) for comparison",
    )
    p.add_argument("--json", dest="json_out", type=Path, help="write results here")
    p.add_argument("--log-dir", type=Path, help="service logs (default: a temp dir)")


def add_demo_args(p) -> None:
    p.add_argument("--prompt", default=DEMO_PROMPT)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--target")
    p.add_argument("--drafter", default="ngram", choices=["ngram", "none"])


@dataclass
class Baseline:
    token_ids: list[int]
    seconds: float
    logprobs: list = field(repr=False)  # per step, kept to explain a difference


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
    for token, lp in generate_step(
        mx.array(prompt_ids), model, max_tokens=max_tokens, sampler=sampler
    ):
        ids.append(token)
        logprobs.append(lp)
        if token in eos_ids:
            break
    return Baseline(ids, time.perf_counter() - start, logprobs)


def top2_margin(logprobs) -> float:
    import mlx.core as mx

    top = mx.topk(logprobs, 2).tolist()
    return abs(top[1] - top[0])


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(rows: list[dict]) -> dict:
    base = sum(r["baseline_s"] for r in rows)
    spec = sum(r["spec_s"] for r in rows)
    rounds = sum(r["rounds"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    split = {
        k: 1000 * sum(r[k] for r in rows) / max(rounds, 1)
        for k in ("draft_s", "verify_s", "coordinator_s")
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
        # in-process seconds / split seconds: what the three processes cost, 1.0 = nothing
        "split_vs_inprocess": (
            sum(r["inproc_s"] for r in rows) / spec
            if rows and "inproc_s" in rows[0] and spec
            else None
        ),
    }


def _service_memory(client) -> dict:
    info = client.info()
    out = {
        "coordinator": info.process.peak_rss_bytes,
        "verifier": info.verifier.process.peak_rss_bytes,
    }
    if info.HasField("drafter"):
        out["drafter"] = info.drafter.process.peak_rss_bytes
    return out


def _drafter_args(args) -> list[str]:
    out = []
    for flag, value in (
        ("--num-draft-tokens", getattr(args, "num_draft_tokens", None)),
        ("--ngram-min-n", getattr(args, "ngram_min_n", None)),
        ("--ngram-max-n", getattr(args, "ngram_max_n", None)),
    ):
        if value is not None:
            out += [flag, str(value)]
    return out


def in_process_runner(args):
    """The same round loop with no gRPC (coordinator/local.py), for the cost of the split."""
    import asyncio

    from coordinator.adaptive import AdaptiveK, SpeculationCosts
    from coordinator.local import LocalDrafter, LocalVerifier
    from coordinator.rounds import Plan, RoundStats, run_rounds
    from drafter_svc.ngram import NgramConfig, NgramProposer
    from specd.models.load import load_target
    from specd.v1 import common_pb2
    from verifier_svc.engine import Target

    config = NgramConfig()
    for name, value in (
        ("num_draft_tokens", args.num_draft_tokens),
        ("min_n", args.ngram_min_n),
        ("max_n", args.ngram_max_n),
    ):
        if value is not None:
            setattr(config, name, value)
    # its own copy of the model: the baseline's stays free of the capture wrappers
    verifier = LocalVerifier(Target(load_target(args.target, args.dtype)))
    drafter = None if args.drafter == "none" else LocalDrafter(NgramProposer(config))
    costs = SpeculationCosts()

    async def consume(prompt_ids, plan, stats):
        async for _ in run_rounds(verifier, drafter, prompt_ids, plan, stats):
            pass

    def run(prompt_ids) -> tuple[float, RoundStats]:
        k = config.num_draft_tokens if drafter else 0
        adaptive = AdaptiveK(costs, k) if args.adaptive and k else None
        plan = Plan(
            args.max_tokens, k, common_pb2.SamplingParams(temperature=args.temperature), adaptive
        )
        stats = RoundStats()
        start = time.perf_counter()
        asyncio.run(consume(prompt_ids, plan, stats))
        return time.perf_counter() - start, stats

    return run


def run_bench(args) -> int:
    from specd.client import CoordinatorClient, make_request
    from specd.datasets import load_questions
    from specd.launch import Stack
    from specd.models.load import load_target
    from specd.prompts import encode_chat

    categories = args.categories.split(",") if args.categories else None
    questions = load_questions(args.questions, limit=args.limit, categories=categories)
    questions = questions[:: max(1, args.every)]
    target = load_target(args.target, args.dtype)
    tokenizer, eos = target.tokenizer, set(target.identity.eos_token_ids)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in questions]
    drafter = None if args.drafter == "none" else args.drafter
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="specd-bench-"))
    print(
        f"bench: {len(questions)} questions, target {target.identity.name} ({target.dtype}), "
        f"drafter {args.drafter}, {args.max_tokens} tokens; logs in {log_dir}",
        file=sys.stderr,
    )
    rows = []
    with Stack(
        target=args.target,
        drafter=drafter,
        dtype=args.dtype,
        drafter_args=_drafter_args(args),
        coordinator_args=[] if args.adaptive else ["--no-adaptive"],
        log_dir=log_dir,
    ) as stack:
        client = CoordinatorClient(stack.coordinator)
        # warm both paths so neither pays first-call compilation in the timings
        plain_decode(target.model, prompts[0], 8, eos)
        client.generate(make_request(prompt_ids=prompts[0], max_tokens=8))
        in_process = in_process_runner(args) if args.in_process else None
        if in_process:
            in_process(prompts[0][:8])
        for i, (question, prompt_ids) in enumerate(zip(questions, prompts, strict=True)):
            base = plain_decode(target.model, prompt_ids, args.max_tokens, eos, args.temperature)
            request = make_request(
                prompt_ids=prompt_ids,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                # k comes from the drafter default: a per-request k would pin it
            )
            start = time.perf_counter()
            spec = client.generate(request)
            spec_s = time.perf_counter() - start
            s = spec.stats
            row = {
                "question_id": question.question_id,
                "category": question.category,
                "tokens": len(spec.token_ids),
                "baseline_tokens": len(base.token_ids),
                "baseline_s": base.seconds,
                "spec_s": spec_s,
                "tau": s["tau"],
                "identical": spec.token_ids == base.token_ids if args.temperature == 0 else None,
                "rounds": s["rounds"],
                "drafted": s["drafted"],
                "accepted": s["accepted"],
                "draft_s": s["draft_s"],
                "verify_s": s["verify_s"],
                "coordinator_s": s["coordinator_s"],
                "prefill_s": s["prefill_s"],
            }
            if in_process:
                row["inproc_s"], inproc = in_process(prompt_ids)
                row["inproc_round_ms"] = 1000 * inproc.total_s / max(inproc.rounds, 1)
            if args.temperature == 0 and not row["identical"]:
                pos = first_difference(spec.token_ids, base.token_ids)
                row["first_difference"] = pos
                if pos is not None and pos < len(base.logprobs):
                    row["baseline_margin"] = top2_margin(base.logprobs[pos])
            rows.append(row)
            same = {None: "", True: "same"}.get(
                row["identical"], f"DIFF at {row.get('first_difference')}"
            )
            print(
                f"[{i + 1}/{len(questions)}] {question.category:<12} "
                f"{base.seconds / spec_s:5.2f}x tau {s['tau']:.2f} {same}",
                file=sys.stderr,
            )
        memory = _service_memory(client)
        client.close()
    result = {
        "target": target.identity.name,
        "drafter": args.drafter,
        "dtype": target.dtype,
        "max_tokens": args.max_tokens,
        "adaptive": args.adaptive,
        "temperature": args.temperature,
        "questions": rows,
        "by_category": {
            c: summarize([r for r in rows if r["category"] == c])
            for c in sorted({r["category"] for r in rows})
        },
        "overall": summarize(rows),
        "peak_rss_bytes": memory,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(format_table(result))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=1))
    return 0


def format_table(result: dict) -> str:
    lines = [
        f"target {result['target']} ({result['dtype']}), drafter {result['drafter']}, "
        f"{result['max_tokens']} tokens, temperature {result['temperature']}",
        f"{'category':<16}{'n':>4}{'speedup':>9}{'tau':>7}{'identical':>11}"
        f"{'plain tok/s':>13}{'spec tok/s':>12}",
    ]
    for name, s in [*result["by_category"].items(), ("OVERALL", result["overall"])]:
        same = "-" if s["identical"] is None else f"{s['identical']}/{s['count']}"
        lines.append(
            f"{name:<16}{s['count']:>4}{s['speedup']:>8.2f}x{s['tau']:>7.2f}{same:>11}"
            f"{s['baseline_tok_s']:>13.2f}{s['spec_tok_s']:>12.2f}"
        )
    ratio = result["overall"].get("split_vs_inprocess")
    if ratio:
        lines.append(f"split vs in-process: {ratio:.3f} (1.0 = the three processes cost nothing)")
    split = result["overall"]["round_split_ms"]
    lines.append(
        f"per round: draft {split['draft']:.1f} ms, verify {split['verify']:.1f} ms, "
        f"coordinator {split['coordinator']:.1f} ms"
    )
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def run_demo(args) -> int:
    """Start the three services, answer one chat prompt, compare with plain mlx-lm."""
    from mlx.utils import tree_flatten

    from specd.client import CoordinatorClient, make_request
    from specd.launch import Stack
    from specd.models.load import load_target
    from specd.prompts import encode_chat

    drafter = None if args.drafter == "none" else args.drafter
    log_dir = Path(tempfile.mkdtemp(prefix="specd-demo-"))
    print(
        f"demo: starting verifier, {drafter or 'no'} drafter and coordinator "
        f"(logs in {log_dir}) ...",
        file=sys.stderr,
    )
    with Stack(target=args.target, drafter=drafter, log_dir=log_dir) as stack:
        client = CoordinatorClient(stack.coordinator)
        print(
            f"demo: ready at {stack.coordinator}\n\nuser: {args.prompt}\n\nassistant: ",
            end="",
            flush=True,
        )
        messages = [{"role": "user", "content": args.prompt}]
        spec = client.generate(
            make_request(messages=messages, max_tokens=args.max_tokens),
            on_text=lambda t: print(t, end="", flush=True),
        )
        memory = _service_memory(client)
        info = client.info()
        client.close()
    print("\n", flush=True)
    target = load_target(
        args.target, info.verifier.dtype if info.verifier.dtype != "native" else "native"
    )
    prompt_ids = encode_chat(target.tokenizer, messages)
    eos = set(target.identity.eos_token_ids)
    plain_decode(target.model, prompt_ids, 4, eos)  # warm up, as the verifier did
    base = plain_decode(target.model, prompt_ids, args.max_tokens, eos)
    s = spec.stats
    weights = sum(v.nbytes for _, v in tree_flatten(target.model.parameters()))
    model = info.verifier.model
    kv_heads = target.model.args.num_key_value_heads
    head_dim = model.hidden_size // target.model.args.num_attention_heads
    context = s["prompt_tokens"] + s["generated_tokens"]
    kv = 2 * model.num_layers * kv_heads * head_dim * 4 * ((context + 255) // 256 * 256)
    print(
        f"tokens            {s['generated_tokens']} ({spec.finish_reason}), "
        f"prompt {s['prompt_tokens']}"
    )
    print(
        f"speculation       {s['generated_tokens'] / s['total_s']:.2f} tok/s, "
        f"tau {s['tau']:.2f} over {s['rounds']} rounds"
    )
    print(f"plain mlx-lm      {len(base.token_ids) / base.seconds:.2f} tok/s")
    print(
        f"speed-up          {base.seconds / s['total_s']:.2f}x  (same model, "
        f"{info.verifier.dtype}, {info.verifier.device})"
    )
    print(f"identical output  {spec.token_ids == base.token_ids}")
    print(
        f"peak RSS          verifier {_mib(memory['verifier'])}, drafter "
        f"{_mib(memory.get('drafter', 0))}, coordinator {_mib(memory['coordinator'])}; "
        f"weights {_mib(weights)} + KV cache {_mib(kv)}"
    )
    return 0
