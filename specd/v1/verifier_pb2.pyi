from specd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifierInfo(_message.Message):
    __slots__ = ("model", "dtype", "device", "max_sessions", "max_context", "max_draft_tokens", "process", "version", "weight_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: _common_pb2.ModelIdentity
    dtype: str
    device: str
    max_sessions: int
    max_context: int
    max_draft_tokens: int
    process: _common_pb2.ProcessStats
    version: str
    weight_bytes: int
    def __init__(self, model: _Optional[_Union[_common_pb2.ModelIdentity, _Mapping]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., max_sessions: _Optional[int] = ..., max_context: _Optional[int] = ..., max_draft_tokens: _Optional[int] = ..., process: _Optional[_Union[_common_pb2.ProcessStats, _Mapping]] = ..., version: _Optional[str] = ..., weight_bytes: _Optional[int] = ...) -> None: ...

class TokenizerFiles(_message.Message):
    __slots__ = ("files",)
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.ScalarMap[str, bytes]
    def __init__(self, files: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("prompt_ids", "capture_layers", "sampling", "rows_dtype")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ROWS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    capture_layers: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    rows_dtype: str
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., capture_layers: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., rows_dtype: _Optional[str] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "first_token", "finished", "hidden_rows", "position", "compute_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_ROWS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    first_token: int
    finished: bool
    hidden_rows: _common_pb2.Tensor
    position: int
    compute_s: float
    def __init__(self, session_id: _Optional[str] = ..., first_token: _Optional[int] = ..., finished: _Optional[bool] = ..., hidden_rows: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., position: _Optional[int] = ..., compute_s: _Optional[float] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "position", "draft_ids", "draft_probs", "draft_parents", "plain_steps")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    position: int
    draft_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _common_pb2.Tensor
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    plain_steps: int
    def __init__(self, session_id: _Optional[str] = ..., position: _Optional[int] = ..., draft_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., draft_parents: _Optional[_Iterable[int]] = ..., plain_steps: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("committed_ids", "num_accepted", "finished", "hidden_rows", "position", "compute_s", "forward_share")
    COMMITTED_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_ROWS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SHARE_FIELD_NUMBER: _ClassVar[int]
    committed_ids: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: int
    finished: bool
    hidden_rows: _common_pb2.Tensor
    position: int
    compute_s: float
    forward_share: float
    def __init__(self, committed_ids: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[int] = ..., finished: _Optional[bool] = ..., hidden_rows: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., position: _Optional[int] = ..., compute_s: _Optional[float] = ..., forward_share: _Optional[float] = ...) -> None: ...
