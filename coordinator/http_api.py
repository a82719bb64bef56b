"""OpenAI-compatible HTTP API on the coordinator: /v1/models, /v1/completions,
/v1/chat/completions, streaming (server-sent events) or not; errors in OpenAI's format.

Defaults follow OpenAI's API (temperature 1, top_p 1); the `specd` field of each response
carries the speculation stats (tau, rounds, drafted, accepted, timings).
"""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web
from google.protobuf.json_format import MessageToDict

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


def _number(body: dict, name: str, default, kind=float, low=None, high=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"'{name}' must be a number", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ApiError(400, f"'{name}' must be between {low} and {high}", param=name)
    return kind(value)


def build_request(body: dict, chat: bool) -> coordinator_pb2.GenerateRequest:
    if body.get("n", 1) != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = 0 if chat else 16  # chat: the coordinator's default; completions: OpenAI's
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ApiError(400, "'max_tokens' must be a positive integer", param="max_tokens")
    request = coordinator_pb2.GenerateRequest(
        max_tokens=max_tokens,
        stop=stop,
        sampling=common_pb2.SamplingParams(
            temperature=_number(body, "temperature", 1.0, float, 0, 2),
            top_p=_number(body, "top_p", 1.0, float, 0, 1),
            top_k=_number(body, "top_k", 0, int, 0),
            min_p=_number(body, "min_p", 0.0, float, 0, 1),
        ),
    )
    if body.get("seed") is not None:
        request.sampling.seed = _number(body, "seed", 0, int, 0) % 2**64
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list", param="messages")
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str) or not isinstance(m.get("role"), str):
                raise ApiError(
                    400, "each message needs a 'role' and text 'content'", param="messages"
                )
            request.chat.messages.add(role=m["role"], content=content)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            request.prompt = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            request.prompt_ids.ids.extend(prompt)
        else:
            raise ApiError(400, "'prompt' must be a string or a list of token ids", param="prompt")
    return request


class OpenAIApi:
    def __init__(self, servicer, model_name: str):
        self.servicer = servicer
        self.model_name = model_name
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 2**20)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    async def models(self, _request: web.Request) -> web.Response:
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "specd",
        }
        return web.json_response({"object": "list", "data": [model]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, http: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await http.json()
            if not isinstance(body, dict):
                raise ApiError(400, "the body must be a JSON object")
            request = build_request(body, chat)
        except json.JSONDecodeError:
            return error_response(ApiError(400, "the body is not valid JSON"))
        except ApiError as err:
            return error_response(err)
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        shape = _Shape(ident, self.model_name, chat)
        events = self.servicer.generate(request)
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
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
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
