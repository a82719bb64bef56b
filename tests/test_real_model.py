"""End to end on the embedded SmolLM2: three service processes vs plain mlx-lm greedy."""

import pytest

from coordinator.bench import plain_decode
from specd.client import CoordinatorClient, make_request
from specd.launch import Stack
from specd.models.load import load_target
from specd.prompts import encode_chat

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "Summarize in three sentences: The city council met on Tuesday to discuss the new park. "
    "Residents asked for more trees, a playground and longer opening hours. The council agreed "
    "to plant trees this autumn and to build the playground next year, but kept the hours.",
    "List five tips for learning a new language, each with one sentence of explanation.",
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with Stack(target=None, drafter="ngram", log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


def test_greedy_identity_128_tokens(stack):
    plain = load_target(None, "auto")
    eos = set(plain.identity.eos_token_ids)
    client = CoordinatorClient(stack.coordinator)
    accepted = 0
    for prompt in PROMPTS:
        ids = encode_chat(plain.tokenizer, [{"role": "user", "content": prompt}])
        expected = plain_decode(plain.model, ids, 128, eos).token_ids
        got = client.generate(make_request(prompt_ids=ids, max_tokens=128))
        assert got.token_ids == expected
        accepted += got.stats["accepted"]
    client.close()
    assert accepted > 0  # the n-gram drafter did take part
