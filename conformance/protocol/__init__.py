"""What an engine author reads: the backend types (``types``), the subprocess wire format, both ends
(``wire``), and the request handling every cache-based backend shares (``serving``: validation, micro-batches, the
``executed`` record). Imports nothing else of conformance.

    from conformance.protocol import Backend, Capabilities, Request, Response, Piece, AudioInput, BackendError
"""

from .types import (
    EMBEDDING_CONVENTIONS,
    ENTRIES,
    KINDS,
    MTP_MODES,
    AudioInput,
    Backend,
    BackendError,
    Capabilities,
    CaseTimeout,
    ImageInput,
    MtpRequest,
    MtpResponse,
    MtpRound,
    Piece,
    Request,
    Response,
    TopLogprobs,
    claims,
    required_capabilities,
)

__all__ = ["EMBEDDING_CONVENTIONS", "ENTRIES", "KINDS", "MTP_MODES", "AudioInput", "Backend", "BackendError",
           "Capabilities", "ImageInput", "CaseTimeout", "MtpRequest", "MtpResponse", "MtpRound", "Piece", "Request",
           "Response", "TopLogprobs", "claims", "required_capabilities"]
