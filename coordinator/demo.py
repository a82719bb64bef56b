"""`specd demo`: the embedded default end to end, next to plain mlx-lm."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from coordinator.bench import MODEL_DRAFTERS, plain_decode, service_memory, timing_prefills

# answered cleanly by the embedded model: code it ends with EOS in ~150 tokens
DEMO_PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def add_demo_args(p) -> None:
    p.add_argument("--prompt", default=DEMO_PROMPT)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--target")
    p.add_argument(
        "--drafter",
        default="ngram",
        choices=["ngram", *MODEL_DRAFTERS, "none"],
        help="the drafter service to start (eagle3 and dflash: the shipped weights for the "
        "embedded model, else --drafter-weights)",
    )
    p.add_argument(
        "--drafter-weights",
        metavar="DIR",
        help="with --drafter eagle3 or dflash: the EAGLE-3 head or DFlash drafter to load (one "
        "trained for --target)",
    )


def _faster(first, second):
    """The generation of the two that took less time."""
    return second if second.stats["total_s"] < first.stats["total_s"] else first


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
    if args.drafter_weights and drafter not in MODEL_DRAFTERS:
        print("demo: --drafter-weights is for --drafter eagle3 or dflash", file=sys.stderr)
        return 2
    log_dir = Path(tempfile.mkdtemp(prefix="specd-demo-"))
    print(
        f"demo: starting verifier, {drafter or 'no'} drafter and coordinator "
        f"(logs in {log_dir}) ...",
        file=sys.stderr,
    )
    # the prompt runs four times: each prefills, as plain mlx-lm's side does
    verifier_args = timing_prefills([])
    weights = ["--weights", args.drafter_weights] if args.drafter_weights else []
    stack = Stack(target=args.target, drafter=drafter, verifier_args=verifier_args,
                  drafter_args=weights, log_dir=log_dir)  # fmt: skip
    try:
        stack.start()
    except (RuntimeError, TimeoutError) as exc:  # e.g. no shipped model drafter for --target
        print(f"demo: the services did not start: {exc}", file=sys.stderr)
        if drafter in MODEL_DRAFTERS and not weights:
            print("demo: where no shipped drafter fits --target, pass one: --drafter-weights DIR",
                  file=sys.stderr)  # fmt: skip
        return 1
    try:
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
        # the same request with drafting off, through the same services: what the drafts add.
        # Each side's figure is the faster of two runs, taken in turn: one run of each moves by
        # 10-20 % on a shared host, enough to credit the drafts with the engine's noise
        plain_services = None
        same_runs = True
        if drafter is not None:
            off = make_request(messages=messages, max_tokens=args.max_tokens, num_draft_tokens=0)
            plain_services = client.generate(off)
            again = client.generate(make_request(messages=messages, max_tokens=args.max_tokens))
            off_again = client.generate(off)
            same_runs = (again.token_ids == spec.token_ids
                         and off_again.token_ids == plain_services.token_ids)  # fmt: skip
            spec, plain_services = _faster(spec, again), _faster(plain_services, off_again)
        memory = service_memory(client)
        info = client.info()
        client.close()
    finally:
        stack.stop()
    print("\n", flush=True)
    target = load_target(
        args.target, info.verifier.dtype if info.verifier.dtype != "native" else "native"
    )
    prompt_ids = encode_chat(target.tokenizer, messages)
    eos = set(target.identity.eos_token_ids)
    plain_decode(target.model, prompt_ids, 4, eos)  # warm up, as the verifier did
    base = plain_decode(target.model, prompt_ids, args.max_tokens, eos)
    if plain_services is not None:  # the faster of two, as the services' figures
        other = plain_decode(target.model, prompt_ids, args.max_tokens, eos)
        base = other if other.seconds < base.seconds else base
    s = spec.stats
    # what the verifier holds (float16 where that is exact); older verifiers do not say
    weights = info.verifier.weight_bytes or sum(
        v.nbytes for _, v in tree_flatten(target.model.parameters())
    )
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
    same = spec.token_ids == base.token_ids
    if plain_services is not None:
        off_s = plain_services.stats["total_s"]
        print(
            f"  from the drafts {off_s / s['total_s']:.2f}x  ({drafter} against drafting off "
            f"through the same services, {len(plain_services.token_ids) / off_s:.2f} tok/s)"
        )
        print(f"  from the engine {base.seconds / off_s:.2f}x  (drafting off against plain mlx-lm)")
        print("                  (each the faster of two runs)")
        same = same and same_runs and plain_services.token_ids == base.token_ids
    print(f"identical output  {same}")
    print(
        f"peak RSS          verifier {_mib(memory['verifier'])}, drafter "
        f"{_mib(memory.get('drafter', 0))}, coordinator {_mib(memory['coordinator'])}; "
        f"weights {_mib(weights)} + KV cache {_mib(kv)}"
    )
    return 0
