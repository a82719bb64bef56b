"""What a verify of k drafts costs the verifier's engine, in one process: the median ms of a
`verify` call with 0 (a plain step), 6 (an EAGLE-3 chain) and 16 (a tree, a DFlash block)
drafts after a prompt, the target as the verifier loads it by default (float32 on a CPU, the
weights float16 holds exactly kept so). The drafts are the vocabulary's last token, which the
target all but never chooses, so each call verifies about the same context length; the drafts
it did accept are printed. --accept drafts the target's own greedy reply instead, so every
draft is kept as in a served round a right drafter makes (the KV and hidden rows of all k + 1
tokens kept, the context growing k + 1 a call). With --profile, cProfile's top functions for
one k. --burst N also times plain decode calls of N steps (a drafting-off or
adaptive-k call), ms a token. --trees N times verifies of draft trees of N nodes (rejected
drafts, the shape a DFlash tree of top-8 takes when each position's candidates halve in
probability), beside chains of as many rows; with --accept the target's greedy reply lies
along the path to the tree's last deepest node off its first line, so every call keeps a path
whose KV rows must be moved into place, as a served tree's accepted side branch is (a tree of
2, a chain, keeps its line in place).
--row-forwards, --compiled-forwards, --kv-pool and --pool-kernel as the verifier takes them
(default auto, as the verifier: on on a GPU); --no-rows keeps no hidden rows (drafting off
and n-gram keep none, the model drafters three layers').

    python benchmarks/verify_cost.py [--drafts 0 6 16] [--calls 15] [--profile 6] [--burst 16]
        [--row-forwards auto|on|off] [--compiled-forwards auto|on|off]
        [--kv-pool auto|on|off] [--pool-kernel auto|on|off] [--no-rows] [--accept]
        [--trees 15 16]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import time

import numpy as np

from drafter_svc.dflash.draft import best_first_tree
from specd.argtypes import positive_int
from specd.models import few_rows
from specd.models.load import load_target
from specd.prompts import encode_chat
from verifier_svc.config import GPU_MODES
from verifier_svc.engine import Target, decode, half_weights_pay, prefill, verify, verify_tree
from verifier_svc.servicer import on_gpu
from verifier_svc.tree import depths

CAPTURE = (1, 14, 26)  # the shipped drafters' target layers
# a request for a long reply: --accept drafts the target's greedy reply to it
LONG_REPLY = "Write a long, detailed essay on the history of printing, from woodblocks to lasers."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="model (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--drafts", type=int, nargs="+", default=[0, 6, 16])
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--profile", type=int, metavar="K", help="profile the calls with K drafts")
    parser.add_argument("--burst", type=int, metavar="N", help="time decode calls of N steps too")
    parser.add_argument("--row-forwards", choices=GPU_MODES, default="auto")
    parser.add_argument("--compiled-forwards", choices=GPU_MODES, default="auto")
    parser.add_argument("--kv-pool", choices=GPU_MODES, default="auto")
    parser.add_argument("--pool-kernel", choices=GPU_MODES, default="auto")
    parser.add_argument("--no-rows", action="store_true", help="keep no hidden rows")
    parser.add_argument(
        "--accept", action="store_true", help="draft the target's greedy reply: every draft kept"
    )
    parser.add_argument(
        "--trees", type=positive_int, nargs="*", default=[], help="tree sizes to time"
    )
    parser.add_argument(
        "--few-rows-layout",
        choices=["auto", *sorted(few_rows.LAYOUTS)],
        help="the few-row kernel's layout (CUDA; default: the shipped one)",
    )
    args = parser.parse_args()
    if args.few_rows_layout:
        few_rows.use(args.few_rows_layout)
    half = half_weights_pay(args.dtype, None)  # as the verifier decides it
    target = Target(
        load_target(args.target, args.dtype, half_weights=half),
        row_forwards=on_gpu(args.row_forwards, "row-forwards"),
        compiled_forwards=on_gpu(args.compiled_forwards, "compiled-forwards"),
        kv_pool=on_gpu(args.kv_pool, "kv-pool"),
        pool_alone=args.kv_pool == "on",  # as the verifier: a lone session keeps its own cache
        pool_kernel=args.pool_kernel,
    )
    print(f"target {target.identity.name} ({target.loaded.dtype}; {target.numpy_part}; "
          f"row forwards {target.row_forwards}, compiled {target.compiled_forwards}, "
          f"pool {target.kv_pool is not None} (a lone session pooled: {target.pool_alone}), "
          f"pool kernel {args.pool_kernel}, few-row layout {few_rows.layout_name()}, "
          f"rows kept {not args.no_rows})")  # fmt: skip
    capture = () if args.no_rows else CAPTURE
    if args.accept:
        prompt = encode_chat(target.loaded.tokenizer, [{"role": "user", "content": LONG_REPLY}])
        longest = max([*args.drafts, *args.trees, args.profile or 0])
        reply = greedy_reply(target, prompt, (args.calls + 3) * (1 + longest))
    else:
        prompt = [1000 + i % 500 for i in range(args.prompt_tokens)]
    # a token the target all but never chooses: the drafts are rejected
    rejected = target.identity.vocab_size - 1
    accepted = asked = 0
    session = None

    def reopen() -> None:
        """A new session at the prompt, the last one closed first (its caches collected),
        so a lone session keeps its own cache as the verifier gives it."""
        nonlocal session
        session = None
        gc.collect()
        session = prefill(target, prompt, capture).session

    def drafts_for(k: int) -> list[int]:
        if not args.accept:
            return [rejected] * k
        done = session.position - len(prompt)  # reply tokens committed
        return reply[done : done + k]

    def calls(k: int, n: int) -> list[float]:
        nonlocal accepted, asked, session
        if session is None or args.accept:  # an accepting session starts at the prompt again
            reopen()
        times = []
        for _ in range(n):
            drafts = drafts_for(k)
            asked += len(drafts)
            start = time.perf_counter()
            accepted += verify(target, session, drafts).num_accepted
            times.append(time.perf_counter() - start)
        return times

    for k in args.drafts:
        calls(k, 3)  # first use of the shapes
        ms = 1000 * statistics.median(calls(k, args.calls))
        print(f"{k:3d} drafts ({k + 1:2d} tokens): {ms:6.1f} ms")
    print(f"drafts accepted in all: {accepted} of {asked}")
    for nodes in args.trees:
        reopen()
        parents = tree_parents(nodes)
        path = deepest_path(parents) if args.accept else []
        times, kept = [], 0
        for _ in range(3 + args.calls):
            drafts = [rejected] * nodes
            if path:
                done = session.position - len(prompt)
                for node, token in zip(path, reply[done : done + len(path)], strict=True):
                    drafts[node] = token
            start = time.perf_counter()
            kept += verify_tree(target, session, drafts, parents).num_accepted
            times.append(time.perf_counter() - start)
        ms = 1000 * statistics.median(times[3:])
        kept_line = f", {kept / len(times):.1f} drafts kept a call" if args.accept else ""
        print(f"tree of {nodes:3d} drafts ({nodes + 1:2d} tokens): {ms:6.1f} ms{kept_line}")
    if args.burst:
        reopen()
        for _ in range(2):  # first use of the shapes
            decode(target, session, args.burst)
        times = []
        for _ in range(args.calls):
            if session.finished:  # an EOS drawn from the prompt's noise
                reopen()
            start = time.perf_counter()
            committed = len(decode(target, session, args.burst).committed)
            times.append((time.perf_counter() - start) / committed)
        ms = 1000 * statistics.median(times)
        print(f"decode calls of {args.burst} steps: {ms:6.2f} ms a token")
    if args.profile is not None:
        profile = cProfile.Profile()
        profile.enable()
        calls(args.profile, args.calls)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(12)


def tree_parents(nodes: int) -> list[int]:
    """A tree's parents as a DFlash tree of top-8 sends them, for a block whose candidates
    halve in probability rank by rank and whose best falls by a factor of sqrt(2) a position."""
    ranked = np.log(0.5) * (np.arange(8)[None, :] + np.arange(16)[:, None] * 0.5)
    return best_first_tree(ranked, nodes)[0]


def deepest_path(parents: list[int]) -> list[int]:
    """The root-to-leaf path to the tree's last deepest node off its first line: a tree is
    listed likeliest line first (drafts 0, 1, 2, ... each the child of the one before), whose
    rows stay in place when kept, so keeping any other path moves KV rows. A chain has only
    its line: the path to its end, in place."""
    depth = depths(parents)
    line = {0}
    while len(line) < len(parents) and parents[len(line)] == len(line) - 1:
        line.add(len(line))
    off = [i for i in range(len(parents)) if i not in line] or list(line)
    node = max(off, key=lambda i: (depth[i], i))
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def greedy_reply(target: Target, prompt: list[int], length: int) -> list[int]:
    """The target's greedy reply to prompt, `length` tokens (fewer where it ends)."""
    opened = prefill(target, prompt)
    reply = [opened.first_token]
    reply += decode(target, opened.session, length - 1).committed
    if len(reply) < length:
        raise SystemExit(f"the reply ended after {len(reply)} of the {length} tokens needed")
    return reply


if __name__ == "__main__":
    main()
