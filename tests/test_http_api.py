"""The OpenAI-compatible API, with the official openai client and with plain HTTP."""

import json
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")  # a dev dependency; `make test` installs it

from specd.launch import Stack, free_port  # noqa: E402


@pytest.fixture(scope="module")
def api(tiny_model_dir, tmp_path_factory):
    port = free_port()
    with Stack(
        target=str(tiny_model_dir),
        drafter="ngram",
        coordinator_args=["--http-port", str(port)],
        log_dir=tmp_path_factory.mktemp("logs"),
    ) as stack:
        yield f"http://127.0.0.1:{port}/v1", stack


@pytest.fixture
def client(api):
    return openai.OpenAI(base_url=api[0], api_key="unused", max_retries=0)


def post(url: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_models(client):
    models = client.models.list()
    assert len(models.data) == 1 and models.data[0].id


def test_completion_greedy_matches_grpc_and_has_usage(client, api):
    from specd.client import CoordinatorClient, make_request

    out = client.completions.create(model="m", prompt="abcabcabc", max_tokens=24, temperature=0)
    grpc_out = CoordinatorClient(api[1].coordinator).generate(
        make_request(prompt="abcabcabc", max_tokens=24)
    )
    assert out.choices[0].text == grpc_out.text
    assert out.usage.completion_tokens == len(grpc_out.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.model_extra["specd"]["rounds"] >= 1


def test_chat_streaming_equals_non_streaming(client):
    kwargs = dict(
        model="m", messages=[{"role": "user", "content": "hi hi hi"}], max_tokens=30, temperature=0
    )
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert whole.choices[0].finish_reason in ("stop", "length")


def test_stop_sequence_and_seeded_sampling(client):
    base = client.completions.create(model="m", prompt="abcabc", max_tokens=30, temperature=0)
    text = base.choices[0].text
    stop = text[4:6]
    cut = client.completions.create(
        model="m", prompt="abcabc", max_tokens=30, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    a, b = (
        client.completions.create(
            model="m", prompt="abcabc", max_tokens=20, temperature=1.0, top_p=0.9, seed=7
        )
        for _ in range(2)
    )
    assert a.choices[0].text == b.choices[0].text


def test_errors_in_openai_format(api, client):
    url = api[0]
    status, body = post(f"{url}/completions", {"prompt": "x", "max_tokens": -1})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, body = post(f"{url}/chat/completions", {"messages": []})
    assert status == 400 and "messages" in body["error"]["message"]
    status, body = post(f"{url}/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = post(f"{url}/completions", {"prompt": "x", "max_tokens": 10**6})
    assert status == 400 and "context limit" in body["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt="x", n=2)
