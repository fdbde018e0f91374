from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    FORWARD: _ClassVar[Phase]
    LOSS: _ClassVar[Phase]
    BACKWARD: _ClassVar[Phase]
    GRAD: _ClassVar[Phase]
    PARAM: _ClassVar[Phase]
    INPUT: _ClassVar[Phase]
    RECORD: _ClassVar[Phase]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    INT8: _ClassVar[DType]
    INT16: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    BOOL: _ClassVar[DType]

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    RAW: _ClassVar[Codec]
    ZSTD: _ClassVar[Codec]
    QUANT_ZSTD: _ClassVar[Codec]
PHASE_UNSPECIFIED: Phase
FORWARD: Phase
LOSS: Phase
BACKWARD: Phase
GRAD: Phase
PARAM: Phase
INPUT: Phase
RECORD: Phase
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT64: DType
INT8: DType
INT16: DType
INT32: DType
INT64: DType
UINT8: DType
BOOL: DType
CODEC_UNSPECIFIED: Codec
RAW: Codec
ZSTD: Codec
QUANT_ZSTD: Codec

class Hello(_message.Message):
    __slots__ = ("protocol_version", "session", "run", "baseline", "framework", "framework_version", "rank", "world_size", "host", "pid", "client_version", "capture", "max_lead", "reference", "precision", "environment", "warnings", "every", "include", "exclude", "start_step", "share_weights", "weight_sync", "layout")
    class EnvironmentEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    BASELINE_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_VERSION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_FIELD_NUMBER: _ClassVar[int]
    MAX_LEAD_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    EVERY_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    SHARE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SYNC_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    session: str
    run: str
    baseline: bool
    framework: str
    framework_version: str
    rank: int
    world_size: int
    host: str
    pid: int
    client_version: str
    capture: str
    max_lead: int
    reference: bool
    precision: str
    environment: _containers.ScalarMap[str, str]
    warnings: _containers.RepeatedScalarFieldContainer[str]
    every: int
    include: _containers.RepeatedScalarFieldContainer[str]
    exclude: _containers.RepeatedScalarFieldContainer[str]
    start_step: int
    share_weights: bool
    weight_sync: WeightSync
    layout: MeshPlace
    def __init__(self, protocol_version: _Optional[int] = ..., session: _Optional[str] = ..., run: _Optional[str] = ..., baseline: _Optional[bool] = ..., framework: _Optional[str] = ..., framework_version: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., client_version: _Optional[str] = ..., capture: _Optional[str] = ..., max_lead: _Optional[int] = ..., reference: _Optional[bool] = ..., precision: _Optional[str] = ..., environment: _Optional[_Mapping[str, str]] = ..., warnings: _Optional[_Iterable[str]] = ..., every: _Optional[int] = ..., include: _Optional[_Iterable[str]] = ..., exclude: _Optional[_Iterable[str]] = ..., start_step: _Optional[int] = ..., share_weights: _Optional[bool] = ..., weight_sync: _Optional[_Union[WeightSync, _Mapping]] = ..., layout: _Optional[_Union[MeshPlace, _Mapping]] = ...) -> None: ...

class MeshPlace(_message.Message):
    __slots__ = ("data_rank", "data_size", "tensor_rank", "tensor_size", "pipeline_rank", "pipeline_size", "context_rank", "context_size", "expert_rank", "expert_size", "source")
    DATA_RANK_FIELD_NUMBER: _ClassVar[int]
    DATA_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_RANK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_RANK_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_RANK_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXPERT_RANK_FIELD_NUMBER: _ClassVar[int]
    EXPERT_SIZE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    data_rank: int
    data_size: int
    tensor_rank: int
    tensor_size: int
    pipeline_rank: int
    pipeline_size: int
    context_rank: int
    context_size: int
    expert_rank: int
    expert_size: int
    source: str
    def __init__(self, data_rank: _Optional[int] = ..., data_size: _Optional[int] = ..., tensor_rank: _Optional[int] = ..., tensor_size: _Optional[int] = ..., pipeline_rank: _Optional[int] = ..., pipeline_size: _Optional[int] = ..., context_rank: _Optional[int] = ..., context_size: _Optional[int] = ..., expert_rank: _Optional[int] = ..., expert_size: _Optional[int] = ..., source: _Optional[str] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("record", "kind", "global_shape", "offset", "scale", "split_by")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        BLOCK: _ClassVar[Placement.Kind]
        PARTIAL: _ClassVar[Placement.Kind]
        MEAN: _ClassVar[Placement.Kind]
    BLOCK: Placement.Kind
    PARTIAL: Placement.Kind
    MEAN: Placement.Kind
    RECORD_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    SPLIT_BY_FIELD_NUMBER: _ClassVar[int]
    record: int
    kind: Placement.Kind
    global_shape: _containers.RepeatedScalarFieldContainer[int]
    offset: _containers.RepeatedScalarFieldContainer[int]
    scale: float
    split_by: str
    def __init__(self, record: _Optional[int] = ..., kind: _Optional[_Union[Placement.Kind, str]] = ..., global_shape: _Optional[_Iterable[int]] = ..., offset: _Optional[_Iterable[int]] = ..., scale: _Optional[float] = ..., split_by: _Optional[str] = ...) -> None: ...

class ModuleInfo(_message.Message):
    __slots__ = ("id", "name", "type")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    id: int
    name: str
    type: str
    def __init__(self, id: _Optional[int] = ..., name: _Optional[str] = ..., type: _Optional[str] = ...) -> None: ...

class ParameterInfo(_message.Message):
    __slots__ = ("id", "name", "module", "module_type", "shape", "dtype")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    MODULE_TYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    id: int
    name: str
    module: str
    module_type: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    def __init__(self, id: _Optional[int] = ..., name: _Optional[str] = ..., module: _Optional[str] = ..., module_type: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("modules", "parameters")
    MODULES_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    modules: _containers.RepeatedCompositeFieldContainer[ModuleInfo]
    parameters: _containers.RepeatedCompositeFieldContainer[ParameterInfo]
    def __init__(self, modules: _Optional[_Iterable[_Union[ModuleInfo, _Mapping]]] = ..., parameters: _Optional[_Iterable[_Union[ParameterInfo, _Mapping]]] = ...) -> None: ...

class Statistics(_message.Message):
    __slots__ = ("count", "sum", "sum_sq", "min", "max", "abs_max", "nan_count", "inf_count", "m2")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    SUM_SQ_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    ABS_MAX_FIELD_NUMBER: _ClassVar[int]
    NAN_COUNT_FIELD_NUMBER: _ClassVar[int]
    INF_COUNT_FIELD_NUMBER: _ClassVar[int]
    M2_FIELD_NUMBER: _ClassVar[int]
    count: _containers.RepeatedScalarFieldContainer[int]
    sum: _containers.RepeatedScalarFieldContainer[float]
    sum_sq: _containers.RepeatedScalarFieldContainer[float]
    min: _containers.RepeatedScalarFieldContainer[float]
    max: _containers.RepeatedScalarFieldContainer[float]
    abs_max: _containers.RepeatedScalarFieldContainer[float]
    nan_count: _containers.RepeatedScalarFieldContainer[int]
    inf_count: _containers.RepeatedScalarFieldContainer[int]
    m2: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, count: _Optional[_Iterable[int]] = ..., sum: _Optional[_Iterable[float]] = ..., sum_sq: _Optional[_Iterable[float]] = ..., min: _Optional[_Iterable[float]] = ..., max: _Optional[_Iterable[float]] = ..., abs_max: _Optional[_Iterable[float]] = ..., nan_count: _Optional[_Iterable[int]] = ..., inf_count: _Optional[_Iterable[int]] = ..., m2: _Optional[_Iterable[float]] = ...) -> None: ...

class Sketches(_message.Message):
    __slots__ = ("buckets", "seed", "record", "values")
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    buckets: int
    seed: int
    record: _containers.RepeatedScalarFieldContainer[int]
    values: bytes
    def __init__(self, buckets: _Optional[int] = ..., seed: _Optional[int] = ..., record: _Optional[_Iterable[int]] = ..., values: _Optional[bytes] = ...) -> None: ...

class StepRecords(_message.Message):
    __slots__ = ("rank", "step", "phase", "target", "call_index", "slot", "dtype", "ndim", "dims", "stats", "dropped", "sketches", "tensor_pieces", "incomplete", "cost", "record_names", "ops", "placements")
    class DroppedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    CALL_INDEX_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NDIM_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    SKETCHES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PIECES_FIELD_NUMBER: _ClassVar[int]
    INCOMPLETE_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    RECORD_NAMES_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    step: int
    phase: _containers.RepeatedScalarFieldContainer[Phase]
    target: _containers.RepeatedScalarFieldContainer[int]
    call_index: _containers.RepeatedScalarFieldContainer[int]
    slot: _containers.RepeatedScalarFieldContainer[int]
    dtype: _containers.RepeatedScalarFieldContainer[DType]
    ndim: _containers.RepeatedScalarFieldContainer[int]
    dims: _containers.RepeatedScalarFieldContainer[int]
    stats: Statistics
    dropped: _containers.ScalarMap[str, int]
    sketches: Sketches
    tensor_pieces: int
    incomplete: _containers.RepeatedScalarFieldContainer[Phase]
    cost: CaptureCost
    record_names: _containers.RepeatedScalarFieldContainer[str]
    ops: OpTrace
    placements: _containers.RepeatedCompositeFieldContainer[Placement]
    def __init__(self, rank: _Optional[int] = ..., step: _Optional[int] = ..., phase: _Optional[_Iterable[_Union[Phase, str]]] = ..., target: _Optional[_Iterable[int]] = ..., call_index: _Optional[_Iterable[int]] = ..., slot: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Iterable[_Union[DType, str]]] = ..., ndim: _Optional[_Iterable[int]] = ..., dims: _Optional[_Iterable[int]] = ..., stats: _Optional[_Union[Statistics, _Mapping]] = ..., dropped: _Optional[_Mapping[str, int]] = ..., sketches: _Optional[_Union[Sketches, _Mapping]] = ..., tensor_pieces: _Optional[int] = ..., incomplete: _Optional[_Iterable[_Union[Phase, str]]] = ..., cost: _Optional[_Union[CaptureCost, _Mapping]] = ..., record_names: _Optional[_Iterable[str]] = ..., ops: _Optional[_Union[OpTrace, _Mapping]] = ..., placements: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ...) -> None: ...

class OpTensor(_message.Message):
    __slots__ = ("dtype", "shape", "stats", "values")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    stats: _containers.RepeatedScalarFieldContainer[float]
    values: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., stats: _Optional[_Iterable[float]] = ..., values: _Optional[bytes] = ...) -> None: ...

class OpCall(_message.Message):
    __slots__ = ("op", "api", "file", "line", "code", "inputs", "output")
    OP_FIELD_NUMBER: _ClassVar[int]
    API_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    op: str
    api: str
    file: str
    line: int
    code: str
    inputs: _containers.RepeatedScalarFieldContainer[int]
    output: OpTensor
    def __init__(self, op: _Optional[str] = ..., api: _Optional[str] = ..., file: _Optional[str] = ..., line: _Optional[int] = ..., code: _Optional[str] = ..., inputs: _Optional[_Iterable[int]] = ..., output: _Optional[_Union[OpTensor, _Mapping]] = ...) -> None: ...

class OpTrace(_message.Message):
    __slots__ = ("zoom_id", "module", "calls", "externals", "calls_dropped", "error")
    ZOOM_ID_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    EXTERNALS_FIELD_NUMBER: _ClassVar[int]
    CALLS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    zoom_id: int
    module: str
    calls: _containers.RepeatedCompositeFieldContainer[OpCall]
    externals: _containers.RepeatedCompositeFieldContainer[OpTensor]
    calls_dropped: int
    error: str
    def __init__(self, zoom_id: _Optional[int] = ..., module: _Optional[str] = ..., calls: _Optional[_Iterable[_Union[OpCall, _Mapping]]] = ..., externals: _Optional[_Iterable[_Union[OpTensor, _Mapping]]] = ..., calls_dropped: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class CaptureCost(_message.Message):
    __slots__ = ("bytes_captured", "bytes_read", "stats_offloaded", "stats_inline", "boundary_us", "steps")
    BYTES_CAPTURED_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    STATS_OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    STATS_INLINE_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_US_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    bytes_captured: int
    bytes_read: int
    stats_offloaded: int
    stats_inline: int
    boundary_us: int
    steps: int
    def __init__(self, bytes_captured: _Optional[int] = ..., bytes_read: _Optional[int] = ..., stats_offloaded: _Optional[int] = ..., stats_inline: _Optional[int] = ..., boundary_us: _Optional[int] = ..., steps: _Optional[int] = ...) -> None: ...

class TensorPiece(_message.Message):
    __slots__ = ("step", "record", "offset", "numel", "codec", "raw_nbytes", "error_bound", "quant_step", "same_records", "data")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    RAW_NBYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_BOUND_FIELD_NUMBER: _ClassVar[int]
    QUANT_STEP_FIELD_NUMBER: _ClassVar[int]
    SAME_RECORDS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    step: int
    record: int
    offset: int
    numel: int
    codec: Codec
    raw_nbytes: int
    error_bound: float
    quant_step: float
    same_records: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, step: _Optional[int] = ..., record: _Optional[int] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ..., codec: _Optional[_Union[Codec, str]] = ..., raw_nbytes: _Optional[int] = ..., error_bound: _Optional[float] = ..., quant_step: _Optional[float] = ..., same_records: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class CaptureHealth(_message.Message):
    __slots__ = ("failures", "failed_steps", "first_failed_step", "last_failed_step", "step_error", "dropped", "missing", "missing_unlisted")
    class DroppedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    FAILED_STEPS_FIELD_NUMBER: _ClassVar[int]
    FIRST_FAILED_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILED_STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_ERROR_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    MISSING_UNLISTED_FIELD_NUMBER: _ClassVar[int]
    failures: _containers.RepeatedCompositeFieldContainer[CaptureFailure]
    failed_steps: int
    first_failed_step: int
    last_failed_step: int
    step_error: str
    dropped: _containers.ScalarMap[str, int]
    missing: _containers.RepeatedCompositeFieldContainer[MissingSteps]
    missing_unlisted: int
    def __init__(self, failures: _Optional[_Iterable[_Union[CaptureFailure, _Mapping]]] = ..., failed_steps: _Optional[int] = ..., first_failed_step: _Optional[int] = ..., last_failed_step: _Optional[int] = ..., step_error: _Optional[str] = ..., dropped: _Optional[_Mapping[str, int]] = ..., missing: _Optional[_Iterable[_Union[MissingSteps, _Mapping]]] = ..., missing_unlisted: _Optional[int] = ...) -> None: ...

class MissingSteps(_message.Message):
    __slots__ = ("first_step", "last_step", "reason", "detail")
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    first_step: int
    last_step: int
    reason: str
    detail: str
    def __init__(self, first_step: _Optional[int] = ..., last_step: _Optional[int] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class CaptureFailure(_message.Message):
    __slots__ = ("phase", "name", "count", "first_step", "last_step", "error")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    phase: Phase
    name: str
    count: int
    first_step: int
    last_step: int
    error: str
    def __init__(self, phase: _Optional[_Union[Phase, str]] = ..., name: _Optional[str] = ..., count: _Optional[int] = ..., first_step: _Optional[int] = ..., last_step: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class Close(_message.Message):
    __slots__ = ("reason", "last_step", "dropped")
    class DroppedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REASON_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    reason: str
    last_step: int
    dropped: _containers.ScalarMap[str, int]
    def __init__(self, reason: _Optional[str] = ..., last_step: _Optional[int] = ..., dropped: _Optional[_Mapping[str, int]] = ...) -> None: ...

class HaltAck(_message.Message):
    __slots__ = ("request_id", "current_step")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CURRENT_STEP_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    current_step: int
    def __init__(self, request_id: _Optional[int] = ..., current_step: _Optional[int] = ...) -> None: ...

class ClientMessage(_message.Message):
    __slots__ = ("hello", "manifest", "step", "close", "halt_ack", "tensor", "health", "setup")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    HALT_ACK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    SETUP_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    manifest: Manifest
    step: StepRecords
    close: Close
    halt_ack: HaltAck
    tensor: TensorPiece
    health: CaptureHealth
    setup: Setup
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., step: _Optional[_Union[StepRecords, _Mapping]] = ..., close: _Optional[_Union[Close, _Mapping]] = ..., halt_ack: _Optional[_Union[HaltAck, _Mapping]] = ..., tensor: _Optional[_Union[TensorPiece, _Mapping]] = ..., health: _Optional[_Union[CaptureHealth, _Mapping]] = ..., setup: _Optional[_Union[Setup, _Mapping]] = ...) -> None: ...

class Setup(_message.Message):
    __slots__ = ("rank", "framework", "values", "groups", "modules", "warnings", "digest")
    RANK_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    rank: int
    framework: str
    values: _containers.RepeatedCompositeFieldContainer[SetupValue]
    groups: _containers.RepeatedCompositeFieldContainer[ParameterGroup]
    modules: _containers.RepeatedCompositeFieldContainer[ModuleSetup]
    warnings: _containers.RepeatedScalarFieldContainer[str]
    digest: str
    def __init__(self, rank: _Optional[int] = ..., framework: _Optional[str] = ..., values: _Optional[_Iterable[_Union[SetupValue, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[ParameterGroup, _Mapping]]] = ..., modules: _Optional[_Iterable[_Union[ModuleSetup, _Mapping]]] = ..., warnings: _Optional[_Iterable[str]] = ..., digest: _Optional[str] = ...) -> None: ...

class SetupValue(_message.Message):
    __slots__ = ("category", "key", "number", "text", "flag", "derived")
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FLAG_FIELD_NUMBER: _ClassVar[int]
    DERIVED_FIELD_NUMBER: _ClassVar[int]
    category: str
    key: str
    number: float
    text: str
    flag: bool
    derived: bool
    def __init__(self, category: _Optional[str] = ..., key: _Optional[str] = ..., number: _Optional[float] = ..., text: _Optional[str] = ..., flag: _Optional[bool] = ..., derived: _Optional[bool] = ...) -> None: ...

class ParameterGroup(_message.Message):
    __slots__ = ("values", "parameters", "parameters_unlisted")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_UNLISTED_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedCompositeFieldContainer[SetupValue]
    parameters: _containers.RepeatedScalarFieldContainer[str]
    parameters_unlisted: int
    def __init__(self, values: _Optional[_Iterable[_Union[SetupValue, _Mapping]]] = ..., parameters: _Optional[_Iterable[str]] = ..., parameters_unlisted: _Optional[int] = ...) -> None: ...

class ModuleSetup(_message.Message):
    __slots__ = ("name", "type", "values")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    values: _containers.RepeatedCompositeFieldContainer[SetupValue]
    def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ..., values: _Optional[_Iterable[_Union[SetupValue, _Mapping]]] = ...) -> None: ...

class PreflightFinding(_message.Message):
    __slots__ = ("candidate_run", "category", "key", "baseline", "candidate", "affects", "affects_unlisted", "message", "severity", "explained", "explanation")
    CANDIDATE_RUN_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    BASELINE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_FIELD_NUMBER: _ClassVar[int]
    AFFECTS_FIELD_NUMBER: _ClassVar[int]
    AFFECTS_UNLISTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    EXPLAINED_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    candidate_run: str
    category: str
    key: str
    baseline: str
    candidate: str
    affects: _containers.RepeatedScalarFieldContainer[str]
    affects_unlisted: int
    message: str
    severity: str
    explained: bool
    explanation: str
    def __init__(self, candidate_run: _Optional[str] = ..., category: _Optional[str] = ..., key: _Optional[str] = ..., baseline: _Optional[str] = ..., candidate: _Optional[str] = ..., affects: _Optional[_Iterable[str]] = ..., affects_unlisted: _Optional[int] = ..., message: _Optional[str] = ..., severity: _Optional[str] = ..., explained: _Optional[bool] = ..., explanation: _Optional[str] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("protocol_version", "last_step_received", "lossy", "max_step_tensor_bytes", "stream_to")
    class LossyEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: LossyBound
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[LossyBound, _Mapping]] = ...) -> None: ...
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    LOSSY_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_TENSOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAM_TO_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    last_step_received: int
    lossy: _containers.MessageMap[str, LossyBound]
    max_step_tensor_bytes: int
    stream_to: str
    def __init__(self, protocol_version: _Optional[int] = ..., last_step_received: _Optional[int] = ..., lossy: _Optional[_Mapping[str, LossyBound]] = ..., max_step_tensor_bytes: _Optional[int] = ..., stream_to: _Optional[str] = ...) -> None: ...

class LossyBound(_message.Message):
    __slots__ = ("rms_fraction", "absolute")
    RMS_FRACTION_FIELD_NUMBER: _ClassVar[int]
    ABSOLUTE_FIELD_NUMBER: _ClassVar[int]
    rms_fraction: float
    absolute: float
    def __init__(self, rms_fraction: _Optional[float] = ..., absolute: _Optional[float] = ...) -> None: ...

class Credit(_message.Message):
    __slots__ = ("max_step", "acked_step")
    MAX_STEP_FIELD_NUMBER: _ClassVar[int]
    ACKED_STEP_FIELD_NUMBER: _ClassVar[int]
    max_step: int
    acked_step: int
    def __init__(self, max_step: _Optional[int] = ..., acked_step: _Optional[int] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("kind", "reason", "at_step", "request_id", "zoom")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Command.Kind]
        HALT_PREPARE: _ClassVar[Command.Kind]
        HALT: _ClassVar[Command.Kind]
        STEP_QUERY: _ClassVar[Command.Kind]
        ZOOM: _ClassVar[Command.Kind]
    KIND_UNSPECIFIED: Command.Kind
    HALT_PREPARE: Command.Kind
    HALT: Command.Kind
    STEP_QUERY: Command.Kind
    ZOOM: Command.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ZOOM_FIELD_NUMBER: _ClassVar[int]
    kind: Command.Kind
    reason: str
    at_step: int
    request_id: int
    zoom: ZoomSpec
    def __init__(self, kind: _Optional[_Union[Command.Kind, str]] = ..., reason: _Optional[str] = ..., at_step: _Optional[int] = ..., request_id: _Optional[int] = ..., zoom: _Optional[_Union[ZoomSpec, _Mapping]] = ...) -> None: ...

class ZoomSpec(_message.Message):
    __slots__ = ("id", "modules", "capture", "sketch", "every", "first_step", "last_step", "bundle_module", "divergent_step", "reason", "ops_module")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_FIELD_NUMBER: _ClassVar[int]
    SKETCH_FIELD_NUMBER: _ClassVar[int]
    EVERY_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_MODULE_FIELD_NUMBER: _ClassVar[int]
    DIVERGENT_STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    OPS_MODULE_FIELD_NUMBER: _ClassVar[int]
    id: int
    modules: _containers.RepeatedScalarFieldContainer[str]
    capture: str
    sketch: bool
    every: int
    first_step: int
    last_step: int
    bundle_module: str
    divergent_step: int
    reason: str
    ops_module: str
    def __init__(self, id: _Optional[int] = ..., modules: _Optional[_Iterable[str]] = ..., capture: _Optional[str] = ..., sketch: _Optional[bool] = ..., every: _Optional[int] = ..., first_step: _Optional[int] = ..., last_step: _Optional[int] = ..., bundle_module: _Optional[str] = ..., divergent_step: _Optional[int] = ..., reason: _Optional[str] = ..., ops_module: _Optional[str] = ...) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("welcome", "credit", "command", "event")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    credit: Credit
    command: Command
    event: Event
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., credit: _Optional[_Union[Credit, _Mapping]] = ..., command: _Optional[_Union[Command, _Mapping]] = ..., event: _Optional[_Union[Event, _Mapping]] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("name", "baseline", "framework", "ranks", "last_step", "state", "dropped", "health", "environment", "warnings", "dropped_by_reason", "first_step", "reference", "records_received", "steps_resent", "capture_cost", "weight_sync", "layout", "layout_text")
    class EnvironmentEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class DroppedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    BASELINE_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    RECORDS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    STEPS_RESENT_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_COST_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SYNC_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_TEXT_FIELD_NUMBER: _ClassVar[int]
    name: str
    baseline: bool
    framework: str
    ranks: int
    last_step: int
    state: str
    dropped: int
    health: _containers.RepeatedCompositeFieldContainer[RankHealth]
    environment: _containers.ScalarMap[str, str]
    warnings: _containers.RepeatedScalarFieldContainer[str]
    dropped_by_reason: _containers.ScalarMap[str, int]
    first_step: int
    reference: bool
    records_received: int
    steps_resent: int
    capture_cost: CaptureCost
    weight_sync: WeightSync
    layout: MeshPlace
    layout_text: str
    def __init__(self, name: _Optional[str] = ..., baseline: _Optional[bool] = ..., framework: _Optional[str] = ..., ranks: _Optional[int] = ..., last_step: _Optional[int] = ..., state: _Optional[str] = ..., dropped: _Optional[int] = ..., health: _Optional[_Iterable[_Union[RankHealth, _Mapping]]] = ..., environment: _Optional[_Mapping[str, str]] = ..., warnings: _Optional[_Iterable[str]] = ..., dropped_by_reason: _Optional[_Mapping[str, int]] = ..., first_step: _Optional[int] = ..., reference: _Optional[bool] = ..., records_received: _Optional[int] = ..., steps_resent: _Optional[int] = ..., capture_cost: _Optional[_Union[CaptureCost, _Mapping]] = ..., weight_sync: _Optional[_Union[WeightSync, _Mapping]] = ..., layout: _Optional[_Union[MeshPlace, _Mapping]] = ..., layout_text: _Optional[str] = ...) -> None: ...

class RankHealth(_message.Message):
    __slots__ = ("rank", "capture")
    RANK_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    capture: CaptureHealth
    def __init__(self, rank: _Optional[int] = ..., capture: _Optional[_Union[CaptureHealth, _Mapping]] = ...) -> None: ...

class Divergence(_message.Message):
    __slots__ = ("step", "rank", "phase", "module", "candidate_module", "metric", "value", "tolerance", "candidate_run", "stage", "gaps_before", "after_gap", "gaps_summary", "origin", "crossed", "path", "explained_by", "merged_from")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_MODULE_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_RUN_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    GAPS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    AFTER_GAP_FIELD_NUMBER: _ClassVar[int]
    GAPS_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    CROSSED_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    EXPLAINED_BY_FIELD_NUMBER: _ClassVar[int]
    MERGED_FROM_FIELD_NUMBER: _ClassVar[int]
    step: int
    rank: int
    phase: str
    module: str
    candidate_module: str
    metric: str
    value: float
    tolerance: float
    candidate_run: str
    stage: str
    gaps_before: _containers.RepeatedCompositeFieldContainer[Gap]
    after_gap: bool
    gaps_summary: str
    origin: OriginEvidence
    crossed: ToleranceCrossing
    path: _containers.RepeatedCompositeFieldContainer[PathStep]
    explained_by: _containers.RepeatedCompositeFieldContainer[ExplainedFinding]
    merged_from: str
    def __init__(self, step: _Optional[int] = ..., rank: _Optional[int] = ..., phase: _Optional[str] = ..., module: _Optional[str] = ..., candidate_module: _Optional[str] = ..., metric: _Optional[str] = ..., value: _Optional[float] = ..., tolerance: _Optional[float] = ..., candidate_run: _Optional[str] = ..., stage: _Optional[str] = ..., gaps_before: _Optional[_Iterable[_Union[Gap, _Mapping]]] = ..., after_gap: _Optional[bool] = ..., gaps_summary: _Optional[str] = ..., origin: _Optional[_Union[OriginEvidence, _Mapping]] = ..., crossed: _Optional[_Union[ToleranceCrossing, _Mapping]] = ..., path: _Optional[_Iterable[_Union[PathStep, _Mapping]]] = ..., explained_by: _Optional[_Iterable[_Union[ExplainedFinding, _Mapping]]] = ..., merged_from: _Optional[str] = ...) -> None: ...

class PathStep(_message.Message):
    __slots__ = ("step", "phase", "module", "metric", "error", "input_error", "note")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INPUT_ERROR_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    step: int
    phase: str
    module: str
    metric: str
    error: float
    input_error: float
    note: str
    def __init__(self, step: _Optional[int] = ..., phase: _Optional[str] = ..., module: _Optional[str] = ..., metric: _Optional[str] = ..., error: _Optional[float] = ..., input_error: _Optional[float] = ..., note: _Optional[str] = ...) -> None: ...

class ExplainedFinding(_message.Message):
    __slots__ = ("category", "key", "baseline", "candidate", "module", "message")
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    BASELINE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    category: str
    key: str
    baseline: str
    candidate: str
    module: str
    message: str
    def __init__(self, category: _Optional[str] = ..., key: _Optional[str] = ..., baseline: _Optional[str] = ..., candidate: _Optional[str] = ..., module: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class OriginEvidence(_message.Message):
    __slots__ = ("evidence", "rule", "ratio", "evidence_step", "involved", "involved_total")
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_STEP_FIELD_NUMBER: _ClassVar[int]
    INVOLVED_FIELD_NUMBER: _ClassVar[int]
    INVOLVED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    evidence: str
    rule: str
    ratio: float
    evidence_step: int
    involved: _containers.RepeatedScalarFieldContainer[str]
    involved_total: int
    def __init__(self, evidence: _Optional[str] = ..., rule: _Optional[str] = ..., ratio: _Optional[float] = ..., evidence_step: _Optional[int] = ..., involved: _Optional[_Iterable[str]] = ..., involved_total: _Optional[int] = ...) -> None: ...

class ToleranceCrossing(_message.Message):
    __slots__ = ("step", "rank", "phase", "module", "metric", "value", "tolerance")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    step: int
    rank: int
    phase: str
    module: str
    metric: str
    value: float
    tolerance: float
    def __init__(self, step: _Optional[int] = ..., rank: _Optional[int] = ..., phase: _Optional[str] = ..., module: _Optional[str] = ..., metric: _Optional[str] = ..., value: _Optional[float] = ..., tolerance: _Optional[float] = ...) -> None: ...

class Gap(_message.Message):
    __slots__ = ("run", "rank", "first_step", "last_step", "phase", "reason")
    RUN_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run: str
    rank: int
    first_step: int
    last_step: int
    phase: str
    reason: str
    def __init__(self, run: _Optional[str] = ..., rank: _Optional[int] = ..., first_step: _Optional[int] = ..., last_step: _Optional[int] = ..., phase: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class StepRange(_message.Message):
    __slots__ = ("first", "last")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    first: int
    last: int
    def __init__(self, first: _Optional[int] = ..., last: _Optional[int] = ...) -> None: ...

class Coverage(_message.Message):
    __slots__ = ("candidate_run", "steps_compared", "compared", "gaps", "declared", "summary", "gaps_unlisted")
    CANDIDATE_RUN_FIELD_NUMBER: _ClassVar[int]
    STEPS_COMPARED_FIELD_NUMBER: _ClassVar[int]
    COMPARED_FIELD_NUMBER: _ClassVar[int]
    GAPS_FIELD_NUMBER: _ClassVar[int]
    DECLARED_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    GAPS_UNLISTED_FIELD_NUMBER: _ClassVar[int]
    candidate_run: str
    steps_compared: int
    compared: _containers.RepeatedCompositeFieldContainer[StepRange]
    gaps: _containers.RepeatedCompositeFieldContainer[Gap]
    declared: _containers.RepeatedScalarFieldContainer[str]
    summary: str
    gaps_unlisted: int
    def __init__(self, candidate_run: _Optional[str] = ..., steps_compared: _Optional[int] = ..., compared: _Optional[_Iterable[_Union[StepRange, _Mapping]]] = ..., gaps: _Optional[_Iterable[_Union[Gap, _Mapping]]] = ..., declared: _Optional[_Iterable[str]] = ..., summary: _Optional[str] = ..., gaps_unlisted: _Optional[int] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("runs", "steps_compared", "stages")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    STEPS_COMPARED_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunStatus]
    steps_compared: int
    stages: _containers.RepeatedCompositeFieldContainer[StageError]
    def __init__(self, runs: _Optional[_Iterable[_Union[RunStatus, _Mapping]]] = ..., steps_compared: _Optional[int] = ..., stages: _Optional[_Iterable[_Union[StageError, _Mapping]]] = ...) -> None: ...

class StageError(_message.Message):
    __slots__ = ("run", "step", "phase", "ratio", "module", "metric", "value", "tolerance", "rank")
    RUN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    run: str
    step: int
    phase: str
    ratio: float
    module: str
    metric: str
    value: float
    tolerance: float
    rank: int
    def __init__(self, run: _Optional[str] = ..., step: _Optional[int] = ..., phase: _Optional[str] = ..., ratio: _Optional[float] = ..., module: _Optional[str] = ..., metric: _Optional[str] = ..., value: _Optional[float] = ..., tolerance: _Optional[float] = ..., rank: _Optional[int] = ...) -> None: ...

class AlertNotice(_message.Message):
    __slots__ = ("level", "message", "kind", "run", "rank")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    level: str
    message: str
    kind: str
    run: str
    rank: int
    def __init__(self, level: _Optional[str] = ..., message: _Optional[str] = ..., kind: _Optional[str] = ..., run: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class HaltNotice(_message.Message):
    __slots__ = ("reason", "run", "at_step")
    REASON_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    reason: str
    run: str
    at_step: int
    def __init__(self, reason: _Optional[str] = ..., run: _Optional[str] = ..., at_step: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("time", "session", "progress", "divergence", "alert", "halt")
    TIME_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DIVERGENCE_FIELD_NUMBER: _ClassVar[int]
    ALERT_FIELD_NUMBER: _ClassVar[int]
    HALT_FIELD_NUMBER: _ClassVar[int]
    time: float
    session: str
    progress: Progress
    divergence: Divergence
    alert: AlertNotice
    halt: HaltNotice
    def __init__(self, time: _Optional[float] = ..., session: _Optional[str] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., divergence: _Optional[_Union[Divergence, _Mapping]] = ..., alert: _Optional[_Union[AlertNotice, _Mapping]] = ..., halt: _Optional[_Union[HaltNotice, _Mapping]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class ModuleRow(_message.Message):
    __slots__ = ("name", "type", "candidate_name", "metric", "value", "tolerance", "divergent", "first", "compared", "noise", "growth", "error_metric", "error", "input_error_metric", "input_error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_NAME_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    DIVERGENT_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    COMPARED_FIELD_NUMBER: _ClassVar[int]
    NOISE_FIELD_NUMBER: _ClassVar[int]
    GROWTH_FIELD_NUMBER: _ClassVar[int]
    ERROR_METRIC_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INPUT_ERROR_METRIC_FIELD_NUMBER: _ClassVar[int]
    INPUT_ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    candidate_name: str
    metric: str
    value: float
    tolerance: float
    divergent: bool
    first: bool
    compared: bool
    noise: float
    growth: float
    error_metric: str
    error: float
    input_error_metric: str
    input_error: float
    def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ..., candidate_name: _Optional[str] = ..., metric: _Optional[str] = ..., value: _Optional[float] = ..., tolerance: _Optional[float] = ..., divergent: _Optional[bool] = ..., first: _Optional[bool] = ..., compared: _Optional[bool] = ..., noise: _Optional[float] = ..., growth: _Optional[float] = ..., error_metric: _Optional[str] = ..., error: _Optional[float] = ..., input_error_metric: _Optional[str] = ..., input_error: _Optional[float] = ...) -> None: ...

class LongRun(_message.Message):
    __slots__ = ("candidate_run", "steps", "window", "first_loss_abs", "first_loss_rel", "loss_mean_abs", "loss_mean_rel", "loss_mean_signed", "grad_norm_mean_rel", "reference_loss_mean_abs", "reference_grad_norm_mean_rel", "verdicts", "coverage")
    CANDIDATE_RUN_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOSS_ABS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOSS_REL_FIELD_NUMBER: _ClassVar[int]
    LOSS_MEAN_ABS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MEAN_REL_FIELD_NUMBER: _ClassVar[int]
    LOSS_MEAN_SIGNED_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_MEAN_REL_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_LOSS_MEAN_ABS_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_GRAD_NORM_MEAN_REL_FIELD_NUMBER: _ClassVar[int]
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_FIELD_NUMBER: _ClassVar[int]
    candidate_run: str
    steps: int
    window: int
    first_loss_abs: float
    first_loss_rel: float
    loss_mean_abs: float
    loss_mean_rel: float
    loss_mean_signed: float
    grad_norm_mean_rel: float
    reference_loss_mean_abs: float
    reference_grad_norm_mean_rel: float
    verdicts: _containers.RepeatedScalarFieldContainer[str]
    coverage: str
    def __init__(self, candidate_run: _Optional[str] = ..., steps: _Optional[int] = ..., window: _Optional[int] = ..., first_loss_abs: _Optional[float] = ..., first_loss_rel: _Optional[float] = ..., loss_mean_abs: _Optional[float] = ..., loss_mean_rel: _Optional[float] = ..., loss_mean_signed: _Optional[float] = ..., grad_norm_mean_rel: _Optional[float] = ..., reference_loss_mean_abs: _Optional[float] = ..., reference_grad_norm_mean_rel: _Optional[float] = ..., verdicts: _Optional[_Iterable[str]] = ..., coverage: _Optional[str] = ...) -> None: ...

class Report(_message.Message):
    __slots__ = ("session", "status", "halted", "runs", "steps_compared", "first_divergence", "stage", "tree", "unmatched_baseline", "unmatched_candidate", "errors", "long_run", "culprit", "proposed_mapping", "headroom", "status_reasons", "coverage", "records", "batch_sync", "zooms", "tensor_steps", "preflight", "operations", "candidates", "layout_mode", "layout_summary", "layout_differences", "replica_mismatches")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HALTED_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    STEPS_COMPARED_FIELD_NUMBER: _ClassVar[int]
    FIRST_DIVERGENCE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    UNMATCHED_BASELINE_FIELD_NUMBER: _ClassVar[int]
    UNMATCHED_CANDIDATE_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    LONG_RUN_FIELD_NUMBER: _ClassVar[int]
    CULPRIT_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_MAPPING_FIELD_NUMBER: _ClassVar[int]
    HEADROOM_FIELD_NUMBER: _ClassVar[int]
    STATUS_REASONS_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SYNC_FIELD_NUMBER: _ClassVar[int]
    ZOOMS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_STEPS_FIELD_NUMBER: _ClassVar[int]
    PREFLIGHT_FIELD_NUMBER: _ClassVar[int]
    OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_MODE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_DIFFERENCES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    session: str
    status: str
    halted: bool
    runs: _containers.RepeatedCompositeFieldContainer[RunStatus]
    steps_compared: int
    first_divergence: Divergence
    stage: str
    tree: _containers.RepeatedCompositeFieldContainer[ModuleRow]
    unmatched_baseline: _containers.RepeatedScalarFieldContainer[str]
    unmatched_candidate: _containers.RepeatedScalarFieldContainer[str]
    errors: _containers.RepeatedScalarFieldContainer[str]
    long_run: _containers.RepeatedCompositeFieldContainer[LongRun]
    culprit: str
    proposed_mapping: str
    headroom: _containers.RepeatedCompositeFieldContainer[Headroom]
    status_reasons: _containers.RepeatedScalarFieldContainer[str]
    coverage: _containers.RepeatedCompositeFieldContainer[Coverage]
    records: _containers.RepeatedCompositeFieldContainer[NamedRecord]
    batch_sync: BatchSync
    zooms: _containers.RepeatedCompositeFieldContainer[ZoomWindow]
    tensor_steps: _containers.RepeatedCompositeFieldContainer[TensorSteps]
    preflight: _containers.RepeatedCompositeFieldContainer[PreflightFinding]
    operations: _containers.RepeatedCompositeFieldContainer[OperationFinding]
    candidates: _containers.RepeatedCompositeFieldContainer[CandidateReport]
    layout_mode: str
    layout_summary: str
    layout_differences: _containers.RepeatedCompositeFieldContainer[LayoutDifference]
    replica_mismatches: _containers.RepeatedCompositeFieldContainer[ReplicaMismatch]
    def __init__(self, session: _Optional[str] = ..., status: _Optional[str] = ..., halted: _Optional[bool] = ..., runs: _Optional[_Iterable[_Union[RunStatus, _Mapping]]] = ..., steps_compared: _Optional[int] = ..., first_divergence: _Optional[_Union[Divergence, _Mapping]] = ..., stage: _Optional[str] = ..., tree: _Optional[_Iterable[_Union[ModuleRow, _Mapping]]] = ..., unmatched_baseline: _Optional[_Iterable[str]] = ..., unmatched_candidate: _Optional[_Iterable[str]] = ..., errors: _Optional[_Iterable[str]] = ..., long_run: _Optional[_Iterable[_Union[LongRun, _Mapping]]] = ..., culprit: _Optional[str] = ..., proposed_mapping: _Optional[str] = ..., headroom: _Optional[_Iterable[_Union[Headroom, _Mapping]]] = ..., status_reasons: _Optional[_Iterable[str]] = ..., coverage: _Optional[_Iterable[_Union[Coverage, _Mapping]]] = ..., records: _Optional[_Iterable[_Union[NamedRecord, _Mapping]]] = ..., batch_sync: _Optional[_Union[BatchSync, _Mapping]] = ..., zooms: _Optional[_Iterable[_Union[ZoomWindow, _Mapping]]] = ..., tensor_steps: _Optional[_Iterable[_Union[TensorSteps, _Mapping]]] = ..., preflight: _Optional[_Iterable[_Union[PreflightFinding, _Mapping]]] = ..., operations: _Optional[_Iterable[_Union[OperationFinding, _Mapping]]] = ..., candidates: _Optional[_Iterable[_Union[CandidateReport, _Mapping]]] = ..., layout_mode: _Optional[str] = ..., layout_summary: _Optional[str] = ..., layout_differences: _Optional[_Iterable[_Union[LayoutDifference, _Mapping]]] = ..., replica_mismatches: _Optional[_Iterable[_Union[ReplicaMismatch, _Mapping]]] = ...) -> None: ...

class LayoutDifference(_message.Message):
    __slots__ = ("run", "phase", "name", "reason", "first_step", "steps")
    RUN_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    run: str
    phase: str
    name: str
    reason: str
    first_step: int
    steps: int
    def __init__(self, run: _Optional[str] = ..., phase: _Optional[str] = ..., name: _Optional[str] = ..., reason: _Optional[str] = ..., first_step: _Optional[int] = ..., steps: _Optional[int] = ...) -> None: ...

class ReplicaMismatch(_message.Message):
    __slots__ = ("run", "step", "phase", "name", "ranks", "agreeing", "statistic", "value", "expected", "text")
    RUN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    AGREEING_FIELD_NUMBER: _ClassVar[int]
    STATISTIC_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    run: str
    step: int
    phase: str
    name: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    agreeing: _containers.RepeatedScalarFieldContainer[int]
    statistic: str
    value: float
    expected: float
    text: str
    def __init__(self, run: _Optional[str] = ..., step: _Optional[int] = ..., phase: _Optional[str] = ..., name: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., agreeing: _Optional[_Iterable[int]] = ..., statistic: _Optional[str] = ..., value: _Optional[float] = ..., expected: _Optional[float] = ..., text: _Optional[str] = ...) -> None: ...

class CandidateReport(_message.Message):
    __slots__ = ("candidate_run", "framework", "status", "status_reasons", "halted", "steps_compared", "first_divergence", "stage", "culprit", "tree", "tree_step", "coverage")
    CANDIDATE_RUN_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STATUS_REASONS_FIELD_NUMBER: _ClassVar[int]
    HALTED_FIELD_NUMBER: _ClassVar[int]
    STEPS_COMPARED_FIELD_NUMBER: _ClassVar[int]
    FIRST_DIVERGENCE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    CULPRIT_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    TREE_STEP_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_FIELD_NUMBER: _ClassVar[int]
    candidate_run: str
    framework: str
    status: str
    status_reasons: _containers.RepeatedScalarFieldContainer[str]
    halted: bool
    steps_compared: int
    first_divergence: Divergence
    stage: str
    culprit: str
    tree: _containers.RepeatedCompositeFieldContainer[ModuleRow]
    tree_step: int
    coverage: str
    def __init__(self, candidate_run: _Optional[str] = ..., framework: _Optional[str] = ..., status: _Optional[str] = ..., status_reasons: _Optional[_Iterable[str]] = ..., halted: _Optional[bool] = ..., steps_compared: _Optional[int] = ..., first_divergence: _Optional[_Union[Divergence, _Mapping]] = ..., stage: _Optional[str] = ..., culprit: _Optional[str] = ..., tree: _Optional[_Iterable[_Union[ModuleRow, _Mapping]]] = ..., tree_step: _Optional[int] = ..., coverage: _Optional[str] = ...) -> None: ...

class OperationSite(_message.Message):
    __slots__ = ("index", "op", "api", "file", "line", "code", "shape")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    API_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    index: int
    op: str
    api: str
    file: str
    line: int
    code: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[int] = ..., op: _Optional[str] = ..., api: _Optional[str] = ..., file: _Optional[str] = ..., line: _Optional[int] = ..., code: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class OperationFinding(_message.Message):
    __slots__ = ("candidate_run", "rank", "step", "module", "candidate_module", "zoom_id", "status", "baseline", "candidate", "metric", "value", "tolerance", "input_value", "ops_baseline", "ops_candidate", "ops_matched", "message")
    CANDIDATE_RUN_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_MODULE_FIELD_NUMBER: _ClassVar[int]
    ZOOM_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    BASELINE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    INPUT_VALUE_FIELD_NUMBER: _ClassVar[int]
    OPS_BASELINE_FIELD_NUMBER: _ClassVar[int]
    OPS_CANDIDATE_FIELD_NUMBER: _ClassVar[int]
    OPS_MATCHED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    candidate_run: str
    rank: int
    step: int
    module: str
    candidate_module: str
    zoom_id: int
    status: str
    baseline: OperationSite
    candidate: OperationSite
    metric: str
    value: float
    tolerance: float
    input_value: float
    ops_baseline: int
    ops_candidate: int
    ops_matched: int
    message: str
    def __init__(self, candidate_run: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., module: _Optional[str] = ..., candidate_module: _Optional[str] = ..., zoom_id: _Optional[int] = ..., status: _Optional[str] = ..., baseline: _Optional[_Union[OperationSite, _Mapping]] = ..., candidate: _Optional[_Union[OperationSite, _Mapping]] = ..., metric: _Optional[str] = ..., value: _Optional[float] = ..., tolerance: _Optional[float] = ..., input_value: _Optional[float] = ..., ops_baseline: _Optional[int] = ..., ops_candidate: _Optional[int] = ..., ops_matched: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ZoomWindow(_message.Message):
    __slots__ = ("spec", "origin", "runs", "state", "captured")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CAPTURED_FIELD_NUMBER: _ClassVar[int]
    spec: ZoomSpec
    origin: str
    runs: _containers.RepeatedScalarFieldContainer[str]
    state: str
    captured: _containers.RepeatedCompositeFieldContainer[ZoomCapture]
    def __init__(self, spec: _Optional[_Union[ZoomSpec, _Mapping]] = ..., origin: _Optional[str] = ..., runs: _Optional[_Iterable[str]] = ..., state: _Optional[str] = ..., captured: _Optional[_Iterable[_Union[ZoomCapture, _Mapping]]] = ...) -> None: ...

class ZoomCapture(_message.Message):
    __slots__ = ("run", "first_step", "last_step")
    RUN_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    run: str
    first_step: int
    last_step: int
    def __init__(self, run: _Optional[str] = ..., first_step: _Optional[int] = ..., last_step: _Optional[int] = ...) -> None: ...

class TensorSteps(_message.Message):
    __slots__ = ("candidate_run", "rank", "first_step", "last_step", "modules", "modules_unlisted", "max_rel_l2", "max_cosine")
    CANDIDATE_RUN_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    MODULES_UNLISTED_FIELD_NUMBER: _ClassVar[int]
    MAX_REL_L2_FIELD_NUMBER: _ClassVar[int]
    MAX_COSINE_FIELD_NUMBER: _ClassVar[int]
    candidate_run: str
    rank: int
    first_step: int
    last_step: int
    modules: _containers.RepeatedScalarFieldContainer[str]
    modules_unlisted: int
    max_rel_l2: float
    max_cosine: float
    def __init__(self, candidate_run: _Optional[str] = ..., rank: _Optional[int] = ..., first_step: _Optional[int] = ..., last_step: _Optional[int] = ..., modules: _Optional[_Iterable[str]] = ..., modules_unlisted: _Optional[int] = ..., max_rel_l2: _Optional[float] = ..., max_cosine: _Optional[float] = ...) -> None: ...

class NamedRecord(_message.Message):
    __slots__ = ("candidate_run", "name", "dtype", "shape", "steps_compared", "steps_diverged", "first_step", "rank", "metric", "value", "tolerance", "baseline_value", "candidate_value", "first_index", "elements_differing", "exact")
    CANDIDATE_RUN_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STEPS_COMPARED_FIELD_NUMBER: _ClassVar[int]
    STEPS_DIVERGED_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    BASELINE_VALUE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_VALUE_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    ELEMENTS_DIFFERING_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    candidate_run: str
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    steps_compared: int
    steps_diverged: int
    first_step: int
    rank: int
    metric: str
    value: float
    tolerance: float
    baseline_value: float
    candidate_value: float
    first_index: _containers.RepeatedScalarFieldContainer[int]
    elements_differing: int
    exact: bool
    def __init__(self, candidate_run: _Optional[str] = ..., name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., steps_compared: _Optional[int] = ..., steps_diverged: _Optional[int] = ..., first_step: _Optional[int] = ..., rank: _Optional[int] = ..., metric: _Optional[str] = ..., value: _Optional[float] = ..., tolerance: _Optional[float] = ..., baseline_value: _Optional[float] = ..., candidate_value: _Optional[float] = ..., first_index: _Optional[_Iterable[int]] = ..., elements_differing: _Optional[int] = ..., exact: _Optional[bool] = ...) -> None: ...

class BatchSync(_message.Message):
    __slots__ = ("published", "delivered", "dropped", "refused", "held_bytes", "budget_bytes")
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    published: int
    delivered: int
    dropped: int
    refused: int
    held_bytes: int
    budget_bytes: int
    def __init__(self, published: _Optional[int] = ..., delivered: _Optional[int] = ..., dropped: _Optional[int] = ..., refused: _Optional[int] = ..., held_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ...) -> None: ...

class Headroom(_message.Message):
    __slots__ = ("candidate_run", "phase", "metric", "value", "tolerance", "step", "module", "dtype")
    CANDIDATE_RUN_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    candidate_run: str
    phase: str
    metric: str
    value: float
    tolerance: float
    step: int
    module: str
    dtype: str
    def __init__(self, candidate_run: _Optional[str] = ..., phase: _Optional[str] = ..., metric: _Optional[str] = ..., value: _Optional[float] = ..., tolerance: _Optional[float] = ..., step: _Optional[int] = ..., module: _Optional[str] = ..., dtype: _Optional[str] = ...) -> None: ...

class HaltRequest(_message.Message):
    __slots__ = ("session", "reason")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session: str
    reason: str
    def __init__(self, session: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class HaltResponse(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, runs: _Optional[_Iterable[str]] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionSummary(_message.Message):
    __slots__ = ("name", "status", "runs", "steps_compared", "in_memory", "created_unix", "last_active_unix", "ended_unix", "first_divergence")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    STEPS_COMPARED_FIELD_NUMBER: _ClassVar[int]
    IN_MEMORY_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAST_ACTIVE_UNIX_FIELD_NUMBER: _ClassVar[int]
    ENDED_UNIX_FIELD_NUMBER: _ClassVar[int]
    FIRST_DIVERGENCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    status: str
    runs: _containers.RepeatedScalarFieldContainer[str]
    steps_compared: int
    in_memory: bool
    created_unix: float
    last_active_unix: float
    ended_unix: float
    first_divergence: str
    def __init__(self, name: _Optional[str] = ..., status: _Optional[str] = ..., runs: _Optional[_Iterable[str]] = ..., steps_compared: _Optional[int] = ..., in_memory: _Optional[bool] = ..., created_unix: _Optional[float] = ..., last_active_unix: _Optional[float] = ..., ended_unix: _Optional[float] = ..., first_divergence: _Optional[str] = ...) -> None: ...

class SessionList(_message.Message):
    __slots__ = ("sessions", "journal")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionSummary]
    journal: str
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionSummary, _Mapping]]] = ..., journal: _Optional[str] = ...) -> None: ...

class HistoryRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class HistoryRow(_message.Message):
    __slots__ = ("phase", "module", "type")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    phase: str
    module: str
    type: str
    def __init__(self, phase: _Optional[str] = ..., module: _Optional[str] = ..., type: _Optional[str] = ...) -> None: ...

class ModuleErrors(_message.Message):
    __slots__ = ("candidate_run", "rows", "first_step", "last_step", "value", "tolerance", "metric", "divergent", "rows_not_kept")
    CANDIDATE_RUN_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    DIVERGENT_FIELD_NUMBER: _ClassVar[int]
    ROWS_NOT_KEPT_FIELD_NUMBER: _ClassVar[int]
    candidate_run: str
    rows: _containers.RepeatedCompositeFieldContainer[HistoryRow]
    first_step: _containers.RepeatedScalarFieldContainer[int]
    last_step: _containers.RepeatedScalarFieldContainer[int]
    value: _containers.RepeatedScalarFieldContainer[float]
    tolerance: _containers.RepeatedScalarFieldContainer[float]
    metric: bytes
    divergent: bytes
    rows_not_kept: int
    def __init__(self, candidate_run: _Optional[str] = ..., rows: _Optional[_Iterable[_Union[HistoryRow, _Mapping]]] = ..., first_step: _Optional[_Iterable[int]] = ..., last_step: _Optional[_Iterable[int]] = ..., value: _Optional[_Iterable[float]] = ..., tolerance: _Optional[_Iterable[float]] = ..., metric: _Optional[bytes] = ..., divergent: _Optional[bytes] = ..., rows_not_kept: _Optional[int] = ...) -> None: ...

class Curve(_message.Message):
    __slots__ = ("run", "reference", "first_step", "last_step", "baseline_loss", "loss", "baseline_grad_norm", "grad_norm", "loss_diff_max", "grad_norm_diff_max")
    RUN_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    BASELINE_LOSS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    BASELINE_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    LOSS_DIFF_MAX_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_DIFF_MAX_FIELD_NUMBER: _ClassVar[int]
    run: str
    reference: bool
    first_step: _containers.RepeatedScalarFieldContainer[int]
    last_step: _containers.RepeatedScalarFieldContainer[int]
    baseline_loss: _containers.RepeatedScalarFieldContainer[float]
    loss: _containers.RepeatedScalarFieldContainer[float]
    baseline_grad_norm: _containers.RepeatedScalarFieldContainer[float]
    grad_norm: _containers.RepeatedScalarFieldContainer[float]
    loss_diff_max: _containers.RepeatedScalarFieldContainer[float]
    grad_norm_diff_max: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, run: _Optional[str] = ..., reference: _Optional[bool] = ..., first_step: _Optional[_Iterable[int]] = ..., last_step: _Optional[_Iterable[int]] = ..., baseline_loss: _Optional[_Iterable[float]] = ..., loss: _Optional[_Iterable[float]] = ..., baseline_grad_norm: _Optional[_Iterable[float]] = ..., grad_norm: _Optional[_Iterable[float]] = ..., loss_diff_max: _Optional[_Iterable[float]] = ..., grad_norm_diff_max: _Optional[_Iterable[float]] = ...) -> None: ...

class History(_message.Message):
    __slots__ = ("session", "metrics", "candidates", "curves", "steps", "noise_multiple", "revision")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    CURVES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    session: str
    metrics: _containers.RepeatedScalarFieldContainer[str]
    candidates: _containers.RepeatedCompositeFieldContainer[ModuleErrors]
    curves: _containers.RepeatedCompositeFieldContainer[Curve]
    steps: int
    noise_multiple: float
    revision: int
    def __init__(self, session: _Optional[str] = ..., metrics: _Optional[_Iterable[str]] = ..., candidates: _Optional[_Iterable[_Union[ModuleErrors, _Mapping]]] = ..., curves: _Optional[_Iterable[_Union[Curve, _Mapping]]] = ..., steps: _Optional[int] = ..., noise_multiple: _Optional[float] = ..., revision: _Optional[int] = ...) -> None: ...

class PublishedBatch(_message.Message):
    __slots__ = ("session", "run", "rank", "step", "value")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    session: str
    run: str
    rank: int
    step: int
    value: BatchValue
    def __init__(self, session: _Optional[str] = ..., run: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., value: _Optional[_Union[BatchValue, _Mapping]] = ...) -> None: ...

class BatchValue(_message.Message):
    __slots__ = ("tensor", "list", "tuple", "dict", "int_value", "float_value", "bool_value", "string_value", "none")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    LIST_FIELD_NUMBER: _ClassVar[int]
    TUPLE_FIELD_NUMBER: _ClassVar[int]
    DICT_FIELD_NUMBER: _ClassVar[int]
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    FLOAT_VALUE_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    STRING_VALUE_FIELD_NUMBER: _ClassVar[int]
    NONE_FIELD_NUMBER: _ClassVar[int]
    tensor: BatchTensor
    list: BatchValues
    tuple: BatchValues
    dict: BatchDict
    int_value: int
    float_value: float
    bool_value: bool
    string_value: str
    none: bool
    def __init__(self, tensor: _Optional[_Union[BatchTensor, _Mapping]] = ..., list: _Optional[_Union[BatchValues, _Mapping]] = ..., tuple: _Optional[_Union[BatchValues, _Mapping]] = ..., dict: _Optional[_Union[BatchDict, _Mapping]] = ..., int_value: _Optional[int] = ..., float_value: _Optional[float] = ..., bool_value: _Optional[bool] = ..., string_value: _Optional[str] = ..., none: _Optional[bool] = ...) -> None: ...

class BatchValues(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[BatchValue]
    def __init__(self, items: _Optional[_Iterable[_Union[BatchValue, _Mapping]]] = ...) -> None: ...

class BatchDict(_message.Message):
    __slots__ = ("keys", "values")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    values: _containers.RepeatedCompositeFieldContainer[BatchValue]
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., values: _Optional[_Iterable[_Union[BatchValue, _Mapping]]] = ...) -> None: ...

class BatchTensor(_message.Message):
    __slots__ = ("dtype", "shape", "codec", "raw_nbytes", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    RAW_NBYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: Codec
    raw_nbytes: int
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., codec: _Optional[_Union[Codec, str]] = ..., raw_nbytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PublishBatchReply(_message.Message):
    __slots__ = ("held", "dropped")
    HELD_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    held: int
    dropped: int
    def __init__(self, held: _Optional[int] = ..., dropped: _Optional[int] = ...) -> None: ...

class BatchRequest(_message.Message):
    __slots__ = ("session", "run", "rank", "step", "wait_seconds")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session: str
    run: str
    rank: int
    step: int
    wait_seconds: float
    def __init__(self, session: _Optional[str] = ..., run: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class BatchReply(_message.Message):
    __slots__ = ("ready", "batch", "waiting_for")
    READY_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    batch: PublishedBatch
    waiting_for: str
    def __init__(self, ready: _Optional[bool] = ..., batch: _Optional[_Union[PublishedBatch, _Mapping]] = ..., waiting_for: _Optional[str] = ...) -> None: ...

class WeightPiece(_message.Message):
    __slots__ = ("parameter", "offset", "numel", "codec", "raw_nbytes", "data")
    PARAMETER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    RAW_NBYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    parameter: int
    offset: int
    numel: int
    codec: Codec
    raw_nbytes: int
    data: bytes
    def __init__(self, parameter: _Optional[int] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ..., codec: _Optional[_Union[Codec, str]] = ..., raw_nbytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WeightsHeader(_message.Message):
    __slots__ = ("session", "run", "framework", "parameters")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    session: str
    run: str
    framework: str
    parameters: _containers.RepeatedCompositeFieldContainer[ParameterInfo]
    def __init__(self, session: _Optional[str] = ..., run: _Optional[str] = ..., framework: _Optional[str] = ..., parameters: _Optional[_Iterable[_Union[ParameterInfo, _Mapping]]] = ...) -> None: ...

class WeightsUpload(_message.Message):
    __slots__ = ("header", "piece")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    header: WeightsHeader
    piece: WeightPiece
    def __init__(self, header: _Optional[_Union[WeightsHeader, _Mapping]] = ..., piece: _Optional[_Union[WeightPiece, _Mapping]] = ...) -> None: ...

class WeightsPublished(_message.Message):
    __slots__ = ("parameters", "bytes")
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    parameters: int
    bytes: int
    def __init__(self, parameters: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class WeightsRequest(_message.Message):
    __slots__ = ("session", "run", "framework", "parameters", "modules", "compress")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_FIELD_NUMBER: _ClassVar[int]
    session: str
    run: str
    framework: str
    parameters: _containers.RepeatedCompositeFieldContainer[ParameterInfo]
    modules: _containers.RepeatedCompositeFieldContainer[ModuleInfo]
    compress: bool
    def __init__(self, session: _Optional[str] = ..., run: _Optional[str] = ..., framework: _Optional[str] = ..., parameters: _Optional[_Iterable[_Union[ParameterInfo, _Mapping]]] = ..., modules: _Optional[_Iterable[_Union[ModuleInfo, _Mapping]]] = ..., compress: _Optional[bool] = ...) -> None: ...

class WeightsDownload(_message.Message):
    __slots__ = ("plan", "piece")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    plan: WeightSync
    piece: WeightPiece
    def __init__(self, plan: _Optional[_Union[WeightSync, _Mapping]] = ..., piece: _Optional[_Union[WeightPiece, _Mapping]] = ...) -> None: ...

class WeightSync(_message.Message):
    __slots__ = ("baseline_run", "baseline_framework", "loaded", "no_counterpart", "unused", "bytes", "seconds", "unlisted")
    BASELINE_RUN_FIELD_NUMBER: _ClassVar[int]
    BASELINE_FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    NO_COUNTERPART_FIELD_NUMBER: _ClassVar[int]
    UNUSED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    UNLISTED_FIELD_NUMBER: _ClassVar[int]
    baseline_run: str
    baseline_framework: str
    loaded: _containers.RepeatedCompositeFieldContainer[LoadedWeight]
    no_counterpart: _containers.RepeatedScalarFieldContainer[str]
    unused: _containers.RepeatedScalarFieldContainer[str]
    bytes: int
    seconds: float
    unlisted: int
    def __init__(self, baseline_run: _Optional[str] = ..., baseline_framework: _Optional[str] = ..., loaded: _Optional[_Iterable[_Union[LoadedWeight, _Mapping]]] = ..., no_counterpart: _Optional[_Iterable[str]] = ..., unused: _Optional[_Iterable[str]] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., unlisted: _Optional[int] = ...) -> None: ...

class LoadedWeight(_message.Message):
    __slots__ = ("parameter", "name", "sources", "transposed", "groups", "part", "dtype", "candidate_dtype")
    PARAMETER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    TRANSPOSED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    parameter: int
    name: str
    sources: _containers.RepeatedScalarFieldContainer[str]
    transposed: _containers.RepeatedScalarFieldContainer[bool]
    groups: int
    part: int
    dtype: DType
    candidate_dtype: DType
    def __init__(self, parameter: _Optional[int] = ..., name: _Optional[str] = ..., sources: _Optional[_Iterable[str]] = ..., transposed: _Optional[_Iterable[bool]] = ..., groups: _Optional[int] = ..., part: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., candidate_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class ZoomRequest(_message.Message):
    __slots__ = ("session", "modules", "capture", "sketch", "every", "steps", "from_step", "bundle", "reason", "ops_module")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_FIELD_NUMBER: _ClassVar[int]
    SKETCH_FIELD_NUMBER: _ClassVar[int]
    EVERY_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    OPS_MODULE_FIELD_NUMBER: _ClassVar[int]
    session: str
    modules: _containers.RepeatedScalarFieldContainer[str]
    capture: str
    sketch: bool
    every: int
    steps: int
    from_step: int
    bundle: bool
    reason: str
    ops_module: str
    def __init__(self, session: _Optional[str] = ..., modules: _Optional[_Iterable[str]] = ..., capture: _Optional[str] = ..., sketch: _Optional[bool] = ..., every: _Optional[int] = ..., steps: _Optional[int] = ..., from_step: _Optional[int] = ..., bundle: _Optional[bool] = ..., reason: _Optional[str] = ..., ops_module: _Optional[str] = ...) -> None: ...

class ZoomResponse(_message.Message):
    __slots__ = ("first_step", "last_step", "runs", "id")
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    first_step: int
    last_step: int
    runs: _containers.RepeatedScalarFieldContainer[str]
    id: int
    def __init__(self, first_step: _Optional[int] = ..., last_step: _Optional[int] = ..., runs: _Optional[_Iterable[str]] = ..., id: _Optional[int] = ...) -> None: ...
