from specd.v1 import common_pb2 as _common_pb2
from specd.v1 import drafter_pb2 as _drafter_pb2
from specd.v1 import verifier_pb2 as _verifier_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SetDrafterRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class CoordinatorInfo(_message.Message):
    __slots__ = ("verifier", "drafter", "pairing_error", "process", "verifier_address", "drafter_address")
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    PAIRING_ERROR_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    verifier: _verifier_pb2.VerifierInfo
    drafter: _drafter_pb2.DrafterInfo
    pairing_error: str
    process: _common_pb2.ProcessStats
    verifier_address: str
    drafter_address: str
    def __init__(self, verifier: _Optional[_Union[_verifier_pb2.VerifierInfo, _Mapping]] = ..., drafter: _Optional[_Union[_drafter_pb2.DrafterInfo, _Mapping]] = ..., pairing_error: _Optional[str] = ..., process: _Optional[_Union[_common_pb2.ProcessStats, _Mapping]] = ..., verifier_address: _Optional[str] = ..., drafter_address: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "chat", "prompt_ids", "max_tokens", "sampling", "stop", "num_draft_tokens", "tree")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    chat: ChatMessages
    prompt_ids: TokenIds
    max_tokens: int
    sampling: _common_pb2.SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    num_draft_tokens: int
    tree: _common_pb2.TreeShape
    def __init__(self, prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., prompt_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., num_draft_tokens: _Optional[int] = ..., tree: _Optional[_Union[_common_pb2.TreeShape, _Mapping]] = ...) -> None: ...

class GenerateStats(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "rounds", "drafted", "accepted", "tau", "prefill_s", "draft_s", "verify_s", "coordinator_s", "total_s", "verify_compute_s", "draft_compute_s", "drafter_failed", "predrafted_rounds", "round_overhead_median_s", "draft_calls", "beside_calls", "verify_calls", "forward_sessions")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FAILED_FIELD_NUMBER: _ClassVar[int]
    PREDRAFTED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_OVERHEAD_MEDIAN_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CALLS_FIELD_NUMBER: _ClassVar[int]
    BESIDE_CALLS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_CALLS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    rounds: int
    drafted: int
    accepted: int
    tau: float
    prefill_s: float
    draft_s: float
    verify_s: float
    coordinator_s: float
    total_s: float
    verify_compute_s: float
    draft_compute_s: float
    drafter_failed: bool
    predrafted_rounds: int
    round_overhead_median_s: float
    draft_calls: int
    beside_calls: int
    verify_calls: int
    forward_sessions: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., tau: _Optional[float] = ..., prefill_s: _Optional[float] = ..., draft_s: _Optional[float] = ..., verify_s: _Optional[float] = ..., coordinator_s: _Optional[float] = ..., total_s: _Optional[float] = ..., verify_compute_s: _Optional[float] = ..., draft_compute_s: _Optional[float] = ..., drafter_failed: _Optional[bool] = ..., predrafted_rounds: _Optional[int] = ..., round_overhead_median_s: _Optional[float] = ..., draft_calls: _Optional[int] = ..., beside_calls: _Optional[int] = ..., verify_calls: _Optional[int] = ..., forward_sessions: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: GenerateStats
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerateStats, _Mapping]] = ...) -> None: ...
