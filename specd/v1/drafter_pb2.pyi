from specd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrafterInfo(_message.Message):
    __slots__ = ("kind", "target_fingerprint", "capture_layers", "default_draft_tokens", "max_draft_tokens", "block_size", "sends_draft_probs", "process", "params", "vocab_size", "accepts_speculative_ids", "default_tree", "drafts_trees", "max_tree_tokens", "text_driven")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    TARGET_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SENDS_DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_SPECULATIVE_IDS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TREE_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_TREES_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_DRIVEN_FIELD_NUMBER: _ClassVar[int]
    kind: str
    target_fingerprint: str
    capture_layers: _containers.RepeatedScalarFieldContainer[int]
    default_draft_tokens: int
    max_draft_tokens: int
    block_size: int
    sends_draft_probs: bool
    process: _common_pb2.ProcessStats
    params: _containers.ScalarMap[str, str]
    vocab_size: int
    accepts_speculative_ids: bool
    default_tree: _common_pb2.TreeShape
    drafts_trees: bool
    max_tree_tokens: int
    text_driven: bool
    def __init__(self, kind: _Optional[str] = ..., target_fingerprint: _Optional[str] = ..., capture_layers: _Optional[_Iterable[int]] = ..., default_draft_tokens: _Optional[int] = ..., max_draft_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., sends_draft_probs: _Optional[bool] = ..., process: _Optional[_Union[_common_pb2.ProcessStats, _Mapping]] = ..., params: _Optional[_Mapping[str, str]] = ..., vocab_size: _Optional[int] = ..., accepts_speculative_ids: _Optional[bool] = ..., default_tree: _Optional[_Union[_common_pb2.TreeShape, _Mapping]] = ..., drafts_trees: _Optional[bool] = ..., max_tree_tokens: _Optional[int] = ..., text_driven: _Optional[bool] = ...) -> None: ...

class DraftOpenRequest(_message.Message):
    __slots__ = ("context_ids", "hidden_rows")
    CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_ROWS_FIELD_NUMBER: _ClassVar[int]
    context_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden_rows: _common_pb2.Tensor
    def __init__(self, context_ids: _Optional[_Iterable[int]] = ..., hidden_rows: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class DraftOpenResponse(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("session_id", "position", "new_ids", "hidden_rows", "num_draft_tokens", "sampling", "speculative_ids", "tree")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    NEW_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_ROWS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_IDS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    position: int
    new_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden_rows: _common_pb2.Tensor
    num_draft_tokens: int
    sampling: _common_pb2.SamplingParams
    speculative_ids: _containers.RepeatedScalarFieldContainer[int]
    tree: _common_pb2.TreeShape
    def __init__(self, session_id: _Optional[str] = ..., position: _Optional[int] = ..., new_ids: _Optional[_Iterable[int]] = ..., hidden_rows: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., num_draft_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., speculative_ids: _Optional[_Iterable[int]] = ..., tree: _Optional[_Union[_common_pb2.TreeShape, _Mapping]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("draft_ids", "draft_probs", "compute_s", "draft_parents", "draft_scores")
    DRAFT_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SCORES_FIELD_NUMBER: _ClassVar[int]
    draft_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _common_pb2.Tensor
    compute_s: float
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    draft_scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, draft_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., compute_s: _Optional[float] = ..., draft_parents: _Optional[_Iterable[int]] = ..., draft_scores: _Optional[_Iterable[float]] = ...) -> None: ...
