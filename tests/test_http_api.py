"""The OpenAI-compatible API, with the official openai client and with plain HTTP."""

import json
import signal
import socket
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")  # a dev dependency; `make test` installs it

from specd.launch import Stack, free_ports  # noqa: E402


@pytest.fixture(scope="module")
def api(tiny_model_dir, tmp_path_factory):
    # one batch, so no two of these (the services' own ports too) can be the same port
    port, metrics_port, verifier_metrics_port, *service_ports = free_ports(6)
    with Stack(
        target=str(tiny_model_dir),
        drafter="ngram",
        ports=dict(zip(("verifier", "drafter", "coordinator"), service_ports, strict=True)),
        verifier_args=["--metrics-port", str(verifier_metrics_port)],
        coordinator_args=["--http-port", str(port), "--metrics-port", str(metrics_port)],
        log_dir=tmp_path_factory.mktemp("logs"),
    ) as stack:
        stack.metrics_port = metrics_port
        stack.verifier_metrics_port = verifier_metrics_port
        yield f"http://127.0.0.1:{port}/v1", stack


@pytest.fixture
def client(api):
    return openai.OpenAI(base_url=api[0], api_key="unused", max_retries=0)


def post(url: str, body, headers=None, method="POST") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
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


X = '"prompt": "x"'
BAD_BODIES = {  # each a 400 in OpenAI's format, none a 500
    "max_tokens above int32": {"prompt": "x", "max_tokens": 2**31},
    "max_tokens huge": b'{"prompt": "x", "max_tokens": 99999999999999999999}',
    "top_k NaN": b"{" + X.encode() + b', "top_k": NaN}',
    "top_k 1e20": {"prompt": "x", "top_k": 1e20},
    "top_k fraction": {"prompt": "x", "top_k": 2.5},
    "seed Infinity": b"{" + X.encode() + b', "seed": Infinity}',
    "seed above uint64": {"prompt": "x", "seed": 2**64},
    "token id above int32": {"prompt": [2**31]},
    "token id a boolean": {"prompt": [True]},
    "a batch of prompts": {"prompt": ["a", "b"]},
    "a text part without text": {"messages": [{"role": "user", "content": [{"text": 5}]}]},
    "an image part": {
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
    },
    "an unknown role": {"messages": [{"role": "wizard", "content": "hi"}]},
    "a lone surrogate": b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
    "a lone surrogate in stop": b"{" + X.encode() + b', "stop": "\\udc00"}',
    "not UTF-8": b'{"prompt": "\xff\xfe"}',
    "nested too deeply": b"[" * 100000,
    "stream not a boolean": {"prompt": "x", "stream": "no"},
    "logprobs": {"prompt": "x", "logprobs": 2},
    "tools": {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
    "model not a string": {"prompt": "x", "model": 5},
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_bad_input_is_a_400_that_names_the_problem(api, case):
    body = BAD_BODIES[case]
    path = (
        "chat/completions"
        if b"messages" in (body if isinstance(body, bytes) else json.dumps(body).encode())
        else "completions"
    )
    status, answer = post(f"{api[0]}/{path}", body)
    assert status == 400, (case, answer)
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]


def test_bad_charset_and_encoding_are_400s(api):
    url = f"{api[0]}/completions"
    status, answer = post(url, {"prompt": "x"}, {"Content-Type": "application/json; charset=foo"})
    assert status == 400 and "charset" in answer["error"]["message"]
    status, answer = post(url, {"prompt": "x"}, {"Content-Encoding": "gzip"})
    assert status == 400 and answer["error"]["message"]
    latin1 = '{"prompt": "caf\u00e9", "max_tokens": 2}'.encode("latin-1")
    status, answer = post(url, latin1, {"Content-Type": "application/json; charset=latin-1"})
    assert status == 200 and answer["choices"][0]["text"] is not None


def test_unknown_paths_and_methods_answer_in_openai_format(api):
    status, answer = post(f"{api[0]}/nothing", {"prompt": "x"})
    assert status == 404 and answer["error"]["type"] == "not_found_error"
    status, answer = post(f"{api[0]}/completions", None, method="GET")
    assert status == 405 and answer["error"]["message"]
    status, answer = post(f"{api[0]}/models/not-this-one", None, method="GET")
    assert status == 404 and answer["error"]["param"] == "model"


def test_a_model_is_found_by_its_id(client):
    name = client.models.list().data[0].id
    assert client.models.retrieve(name).id == name


def _requests_cancelled(stack) -> float:
    from test_metrics import scrape, value

    return value(scrape(stack.metrics_port), 'specd_requests_total{outcome="cancelled"}')


def _verifier_closes(stack) -> float:
    from test_metrics import scrape, value

    return value(
        scrape(stack.verifier_metrics_port), 'specd_rpc_total{code="OK",method="CloseSession"}'
    )


def _open_sessions(stack) -> tuple[int, int]:
    from specd.client import CoordinatorClient

    info = CoordinatorClient(stack.coordinator).info()
    return info.verifier.process.open_sessions, info.drafter.process.open_sessions


def _post_raw(url: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def _wait_cancelled_and_closed(stack, cancelled: float, closes: float) -> None:
    """No sessions open is not enough: a stalled open may not have landed yet. Wait for the
    verifier to have answered the close too."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done = _requests_cancelled(stack) == cancelled and _verifier_closes(stack) >= closes
        if done and _open_sessions(stack) == (0, 0):
            break
        time.sleep(0.05)
    assert _requests_cancelled(stack) == cancelled
    assert _verifier_closes(stack) == closes
    assert _open_sessions(stack) == (0, 0)


# a prompt the tiny target answers at length (~300 tokens), so a generation is under way
LONG = {"prompt": "the quick brown fox", "max_tokens": 1000, "temperature": 0}


def test_a_streaming_client_that_disconnects_ends_its_generation_and_frees_its_sessions(api):
    """A leaked session counts against the verifier's --max-sessions until it idles out."""
    url, stack = api
    verifier = stack.services["verifier"].process
    before, closes = _requests_cancelled(stack), _verifier_closes(stack)
    with _post_raw(url, {**LONG, "stream": True}) as sock:
        seen = b""
        while b"data:" not in seen:  # the generation is under way
            seen += sock.recv(4096)
        verifier.send_signal(signal.SIGSTOP)  # it cannot finish on its own meanwhile
    try:
        time.sleep(0.5)  # the coordinator sees the closed connection
    finally:
        verifier.send_signal(signal.SIGCONT)
    _wait_cancelled_and_closed(stack, before + 1, closes + 1)


def test_a_client_that_leaves_while_its_session_opens_leaves_nothing_open(api):
    """A non-streaming request whose client leaves is cancelled, not run to the end for
    nobody, even while its session is still opening; no session is left behind."""
    url, stack = api
    verifier = stack.services["verifier"].process
    before, closes = _requests_cancelled(stack), _verifier_closes(stack)
    verifier.send_signal(signal.SIGSTOP)  # the session's open waits on it
    try:
        with _post_raw(url, LONG):
            time.sleep(0.5)  # the coordinator has sent OpenSession
        time.sleep(0.5)  # and seen the client go
    finally:
        verifier.send_signal(signal.SIGCONT)
    _wait_cancelled_and_closed(stack, before + 1, closes + 1)
