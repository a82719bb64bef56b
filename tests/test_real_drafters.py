"""The shipped EAGLE-3 head and DFlash drafter on the embedded SmolLM2, through the services:
greedy output equals plain mlx-lm, and the drafts are accepted often enough to matter."""

import pytest

from coordinator.bench import plain_decode
from specd.client import CoordinatorClient, make_request
from specd.launch import Stack, spawn
from specd.models.load import load_target
from specd.prompts import encode_chat
from specd.v1 import common_pb2

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "List five tips for learning a new language, each with one sentence of explanation.",
]
TOKENS = 96


@pytest.fixture(scope="module")
def references():
    plain = load_target(None, "auto")
    eos = set(plain.identity.eos_token_ids)
    out = []
    for prompt in PROMPTS:
        ids = encode_chat(plain.tokenizer, [{"role": "user", "content": prompt}])
        out.append((ids, plain_decode(plain.model, ids, TOKENS, eos).token_ids))
    return out


def _check(stack, references, tree=None, coordinator=None, **request):
    client = CoordinatorClient(coordinator or stack.coordinator)
    rounds = accepted = predrafted = 0
    for ids, expected in references:
        req = make_request(prompt_ids=ids, max_tokens=TOKENS, **request)
        if tree is not None:
            req.tree.CopyFrom(tree)
        got = client.generate(req)
        assert got.token_ids == expected
        rounds += got.stats["rounds"]
        accepted += got.stats["accepted"]
        predrafted += got.stats["predrafted_rounds"]
    client.close()
    if coordinator is not None:
        return predrafted
    return 1 + accepted / rounds


# k pinned and greedy: tau is deterministic. The floors sit under what the shipped models
# reach at k = 4 (dflash: 1.12): a broken serving path drops to 1.0.
FLOORS = {"eagle3": 1.3, "dflash": 1.05}


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_shipped_drafter_is_lossless_and_accepted(kind, references, tmp_path):
    with Stack(target=None, drafter=kind, log_dir=tmp_path) as stack:
        tau = _check(stack, references, num_draft_tokens=4)
        assert tau > FLOORS[kind], f"{kind}: tau {tau:.2f}; the shipped drafter barely drafts right"
        if kind == "eagle3":
            tree = common_pb2.TreeShape(total_tokens=12, depth=4, top_k=3)
            tree_tau = _check(stack, references, tree=tree, num_draft_tokens=4)
            assert tree_tau > 1.3
            _check_overlap(stack, references, tmp_path)


def _check_overlap(stack, references, tmp_path):
    """Chains drafted past the one being verified: still lossless, and some are used."""
    coordinator = spawn(
        "coordinator",
        [
            "--verifier", stack.services["verifier"].address,
            "--drafter", stack.services["drafter"].address,
            "--overlap-drafting",
        ],
        log_dir=tmp_path / "overlap",
    )  # fmt: skip
    try:
        coordinator.wait_healthy(120)
        used = _check(stack, references, coordinator=coordinator.address, num_draft_tokens=1)
        assert used > 0, "no pre-drafted block was ever used"
    finally:
        coordinator.stop()
