"""Old import path of the backend protocol types: ``conformance.protocol`` (kept so that backends written
against ``from conformance.backend import ...`` keep working; see docs/architecture.md, "Migration")."""

from conformance.protocol.types import (
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
    claims,
    required_capabilities,
)

__all__ = ["EMBEDDING_CONVENTIONS", "ENTRIES", "KINDS", "MTP_MODES", "AudioInput", "Backend", "BackendError",
           "Capabilities", "ImageInput", "CaseTimeout", "MtpRequest", "MtpResponse", "MtpRound", "Piece", "Request",
           "Response", "claims", "required_capabilities"]
