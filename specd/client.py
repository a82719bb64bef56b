"""A small synchronous client of the coordinator, for the CLI, benchmarks and tests."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
from google.protobuf.json_format import MessageToDict

from specd.argtypes import INT32_MAX, INT32_MIN
from specd.security import ClientSecurity
from specd.service import channel_options
from specd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc


@dataclass
class Generation:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    stats: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats,
        }


def _in_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, not {value}")


def make_request(
    *,
    prompt: str | None = None,
    messages: list[dict] | None = None,
    prompt_ids: list[int] | None = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    seed: int | None = None,
    stop: list[str] | None = None,
    num_draft_tokens: int | None = None,
    tree: tuple[int, int, int] | None = None,  # (total_tokens, depth, top_k); total 0: chains
) -> coordinator_pb2.GenerateRequest:
    """The request for these options. ValueError names an option its protobuf field cannot
    hold; values it can hold are the coordinator's to judge (INVALID_ARGUMENT, with a reason)."""
    _in_range("max_tokens", max_tokens, INT32_MIN, INT32_MAX)
    _in_range("top_k", top_k, INT32_MIN, INT32_MAX)
    if seed is not None:
        _in_range("seed", seed, 0, 2**64 - 1)
    if num_draft_tokens is not None:
        _in_range("num_draft_tokens", num_draft_tokens, INT32_MIN, INT32_MAX)
    for id_ in prompt_ids or ():
        _in_range("prompt_ids", id_, INT32_MIN, INT32_MAX)
    request = coordinator_pb2.GenerateRequest(
        max_tokens=max_tokens,
        stop=stop or [],
        sampling=common_pb2.SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed
        ),
    )
    if messages is not None:
        request.chat.messages.extend(coordinator_pb2.ChatMessage(**m) for m in messages)
    elif prompt_ids is not None:
        request.prompt_ids.ids.extend(prompt_ids)
    elif prompt is not None:
        request.prompt = prompt
    if num_draft_tokens is not None:
        request.num_draft_tokens = num_draft_tokens
    if tree is not None:
        total, depth, top_k = tree
        request.tree.CopyFrom(common_pb2.TreeShape(total_tokens=total, depth=depth, top_k=top_k))
    return request


class CoordinatorClient:
    def __init__(self, address: str, security: ClientSecurity | None = None):
        security = security or ClientSecurity()
        credentials = security.credentials()
        if credentials is None:
            self.channel = grpc.insecure_channel(address, options=channel_options())
        else:
            self.channel = grpc.secure_channel(address, credentials, options=channel_options())
        self.metadata = security.metadata()
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)

    def info(self, timeout_s: float = 30.0) -> coordinator_pb2.CoordinatorInfo:
        return self.stub.GetInfo(
            common_pb2.InfoRequest(), timeout=timeout_s, metadata=self.metadata
        )

    def stream(
        self, request, timeout_s: float = 3600.0
    ) -> Iterator[coordinator_pb2.GenerateResponse]:
        yield from self.stub.Generate(request, timeout=timeout_s, metadata=self.metadata)

    def generate(self, request, timeout_s: float = 3600.0, on_text=None) -> Generation:
        out = Generation()
        for message in self.stream(request, timeout_s):
            out.text += message.text
            out.token_ids.extend(message.token_ids)
            if on_text and message.text:
                on_text(message.text)
            if message.finish_reason:
                out.finish_reason = message.finish_reason
                out.stats = MessageToDict(
                    message.stats,
                    preserving_proto_field_name=True,
                    always_print_fields_with_no_presence=True,
                )
        return out

    def set_drafter(self, address: str, timeout_s: float = 60.0):
        request = coordinator_pb2.SetDrafterRequest(address=address)
        return self.stub.SetDrafter(request, timeout=timeout_s, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()
