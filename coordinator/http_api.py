"""OpenAI-compatible HTTP API on the coordinator: /v1/models, /v1/completions,
/v1/chat/completions, streaming (server-sent events) or not; errors in OpenAI's format.

Defaults follow OpenAI's API (temperature 1, top_p 1); the `specd` field of each response
carries the speculation stats (tau, rounds, drafted, accepted, timings). The server serves one
model, so `model` may name anything. Fields it cannot honour (logprobs, tools, penalties, ...)
are refused with a 400 rather than ignored.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from contextlib import aclosing

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from google.protobuf.json_format import MessageToDict

from specd.argtypes import INT32_MAX
from specd.service import ServiceError
from specd.v1 import common_pb2, coordinator_pb2

HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 409,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
    "UNAUTHENTICATED": 401,
}
OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_response(err: ApiError) -> web.Response:
    body = {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": None}}
    return web.json_response(body, status=err.status)


ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI fields this server cannot honour: set to anything but their neutral value, refused
UNSUPPORTED = (
    "logprobs",
    "top_logprobs",
    "echo",
    "suffix",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "tools",
    "functions",
)


def _span(low, high) -> str:
    if high is None:
        return f">= {low}"
    if low is None:
        return f"<= {high}"
    return f"between {low} and {high}"


def _number(body: dict, name: str, default, kind=float, low=None, high=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"'{name}' must be a number", param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be a finite number", param=name)
    if kind is int and value != int(value):
        raise ApiError(400, f"'{name}' must be an integer", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ApiError(400, f"'{name}' must be {_span(low, high)}", param=name)
    return kind(value)


def _text(value: str, param: str) -> str:
    """Protobuf strings must be valid UTF-8; JSON can carry unpaired surrogates."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            400,
            f"'{param}' holds text that is not valid Unicode (an unpaired surrogate)",
            param=param,
        ) from None
    return value


def _refuse_unsupported(body: dict) -> None:
    for name in UNSUPPORTED:
        if body.get(name):  # null, false, 0, "" and [] are the neutral values
            raise ApiError(400, f"'{name}' is not supported by this server", param=name)
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "only best_of=1 is supported", param="best_of")
    fmt = body.get("response_format")
    if fmt not in (None, {}) and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise ApiError(
            400, "only response_format {'type': 'text'} is supported", param="response_format"
        )
    if not isinstance(body.get("model", ""), str):
        raise ApiError(400, "'model' must be a string", param="model")
    if body.get("n") not in (None, 1):
        raise ApiError(400, "only n=1 is supported", param="n")
    if body.get("stream") not in (None, True, False):
        raise ApiError(400, "'stream' must be true or false", param="stream")


def _message_text(content, index: int) -> str:
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type", "text") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(
                    400,
                    f"message {index}: only text content parts are supported, not {kind!r}",
                    param="messages",
                )
            if not isinstance(part.get("text"), str):
                raise ApiError(
                    400, f"message {index}: a text part needs a string 'text'", param="messages"
                )
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise ApiError(400, f"message {index} needs text 'content'", param="messages")
    return _text(content, "messages")


def _prompt_ids(prompt: list) -> list[int]:
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        raise ApiError(
            400, "one prompt per request: batches of prompts are not supported", param="prompt"
        )
    if not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in prompt
    ):
        raise ApiError(
            400,
            "'prompt' must be a string or a list of token ids (integers >= 0)",
            param="prompt",
        )
    return prompt


def build_request(body: dict, chat: bool) -> coordinator_pb2.GenerateRequest:
    _refuse_unsupported(body)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
    stop = [_text(s, "stop") for s in stop]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = 0 if chat else 16  # chat: the coordinator's default; completions: OpenAI's
    elif (
        isinstance(max_tokens, bool)
        or not isinstance(max_tokens, int)
        or not 1 <= max_tokens <= INT32_MAX
    ):
        raise ApiError(
            400, f"'max_tokens' must be an integer between 1 and {INT32_MAX}", param="max_tokens"
        )
    request = coordinator_pb2.GenerateRequest(
        max_tokens=max_tokens,
        stop=stop,
        sampling=common_pb2.SamplingParams(
            temperature=_number(body, "temperature", 1.0, float, 0, 2),
            top_p=_number(body, "top_p", 1.0, float, 0, 1),
            top_k=_number(body, "top_k", 0, int, 0, INT32_MAX),
            min_p=_number(body, "min_p", 0.0, float, 0, 1),
        ),
    )
    if body.get("seed") is not None:  # any integer; the sampler takes it modulo 2**64
        request.sampling.seed = _number(body, "seed", 0, int, -(2**63), 2**64 - 1) % 2**64
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list", param="messages")
        for index, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise ApiError(
                    400,
                    f"message {index} needs a 'role', one of {', '.join(ROLES)}",
                    param="messages",
                )
            request.chat.messages.add(
                role=m["role"], content=_message_text(m.get("content"), index)
            )
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            request.prompt = _text(prompt, "prompt")
        elif isinstance(prompt, list) and prompt:
            request.prompt_ids.ids.extend(_prompt_ids(prompt))
        else:
            raise ApiError(400, "'prompt' must be a string or a list of token ids", param="prompt")
    return request


async def read_json(http: web.Request) -> dict:
    """The body as a JSON object, or an ApiError saying what is wrong with it."""
    try:
        raw = await http.read()
    except (BadHttpMessage, web.RequestPayloadError) as err:  # e.g. a wrong Content-Encoding
        cause = err.__cause__ if isinstance(err, web.RequestPayloadError) else err
        reason = getattr(cause, "message", None) or str(cause)
        raise ApiError(400, f"the body cannot be read: {reason}") from None
    try:
        text = raw.decode(http.charset) if http.charset else raw
        body = json.loads(text)
    except LookupError:
        raise ApiError(400, f"unknown charset {http.charset!r} in Content-Type") from None
    except UnicodeDecodeError:
        raise ApiError(
            400, "the body is not valid text in its charset (UTF-8 by default)"
        ) from None
    except json.JSONDecodeError:
        raise ApiError(400, "the body is not valid JSON") from None
    except RecursionError:
        raise ApiError(400, "the body's JSON is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


class OpenAIApi:
    def __init__(self, servicer, model_name: str):
        self.servicer = servicer
        self.model_name = model_name
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 2**20, middlewares=[_openai_errors])
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    def _model(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "specd",
        }

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model()]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.model_name:
            return error_response(
                ApiError(
                    404,
                    f"no model {name!r}; this server serves {self.model_name!r}",
                    kind="not_found_error",
                    param="model",
                )
            )
        return web.json_response(self._model())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, http: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await read_json(http)
            request = build_request(body, chat)
        except ApiError as err:
            return error_response(err)
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        shape = _Shape(ident, self.model_name, chat)
        # closed on every way out (a client that went away included), which closes the
        # generation's verifier and drafter sessions at once rather than when collected
        async with aclosing(self.servicer.generate(request)) as events:
            if body.get("stream"):
                return await self._stream(http, events, shape)
            text, tokens, final = "", 0, None
            try:
                async for message in events:
                    text += message.text
                    tokens += len(message.token_ids)
                    final = message if message.finish_reason else final
            except ServiceError as err:
                return error_response(_api_error(err))
        return web.json_response(shape.whole(text, final, tokens))

    async def _stream(self, http, events, shape) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        first, tokens = True, 0
        try:
            async for message in events:
                if first:
                    await response.prepare(http)
                    first = False
                tokens += len(message.token_ids)
                if message.text or message.finish_reason:
                    chunk = shape.chunk(message.text, message, tokens)
                    await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        except ServiceError as err:
            if first:
                return error_response(_api_error(err))
            error = {"error": {"message": err.message, "type": "server_error"}}
            await response.write(f"data: {json.dumps(error)}\n\n".encode())
        except ConnectionResetError:  # the client went away; the caller closes the generation
            return response
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@web.middleware
async def _openai_errors(request: web.Request, handler):
    """aiohttp's own 404, 405 and 413 answers, in OpenAI's error format."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        response = error_response(
            ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}", kind=kind)
        )
        if "Allow" in exc.headers:  # a 405 says which methods would do
            response.headers["Allow"] = exc.headers["Allow"]
        return response


def _api_error(err: ServiceError) -> ApiError:
    status = HTTP_STATUS.get(err.code.name, 500)
    return ApiError(
        status, err.message, "invalid_request_error" if status < 500 else "server_error"
    )


class _Shape:
    """OpenAI's response objects for completions and chat completions."""

    def __init__(self, ident: str, model: str, chat: bool):
        self.ident, self.model, self.chat = ident, model, chat
        self.created = int(time.time())

    def _base(self, streaming: bool) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.ident,
            "object": kind + (".chunk" if streaming and self.chat else ""),
            "created": self.created,
            "model": self.model,
        }

    def _extras(self, final, tokens: int) -> dict:
        stats = MessageToDict(final.stats, preserving_proto_field_name=True)
        prompt = int(stats.get("prompt_tokens", 0))
        return {
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": tokens,
                "total_tokens": prompt + tokens,
            },
            "specd": stats,
        }

    def whole(self, text: str, final, tokens: int) -> dict:
        reason = OPENAI_FINISH.get(final.finish_reason if final else "", "length")
        choice = {"index": 0, "finish_reason": reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        return {**self._base(False), "choices": [choice], **self._extras(final, tokens)}

    def chunk(self, text: str, message, tokens: int) -> dict:
        reason = OPENAI_FINISH.get(message.finish_reason) if message.finish_reason else None
        choice = {"index": 0, "finish_reason": reason}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if text else {}
        else:
            choice.update(text=text, logprobs=None)
        out = {**self._base(True), "choices": [choice]}
        if message.finish_reason:
            out.update(self._extras(message, tokens))
        return out
