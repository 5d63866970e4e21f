"""Old import path of the subprocess backend: ``conformance.backends.subprocess`` (the client, one engine
process) and ``conformance.protocol.wire`` (the wire format). Kept for code written against it."""

from ..protocol.wire import (
    CAPABILITY_FIELDS,
    PROTOCOL,
    RAW_DTYPES,
    ST_DTYPES,
    V1_CAPABILITY_FIELDS,
    VERSIONS,
    ArrayError,
    EngineCrash,
    EngineError,
    EngineFailure,
    EngineTimeout,
    ProtocolError,
    expected_rows,
    read_array,
    request_to_json,
)
from .subprocess.client import IsolatedBackend, RefimplSubprocessBackend, SubprocessBackend

__all__ = ["CAPABILITY_FIELDS", "PROTOCOL", "RAW_DTYPES", "ST_DTYPES", "V1_CAPABILITY_FIELDS", "VERSIONS", "ArrayError",
           "EngineCrash", "EngineError", "EngineFailure", "EngineTimeout", "IsolatedBackend", "ProtocolError",
           "RefimplSubprocessBackend", "SubprocessBackend", "expected_rows", "read_array", "request_to_json"]
