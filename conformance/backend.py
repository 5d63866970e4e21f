"""Old import path of the backend protocol types: ``conformance.protocol`` (kept so that backends written
against ``from conformance.backend import ...`` keep working; see docs/architecture.md, "Migration")."""

from conformance.protocol.types import (
    EMBEDDING_CONVENTIONS, ENTRIES, KINDS, AudioInput, Backend, BackendError, Capabilities, CaseTimeout, ImageInput, Piece,
    Request, Response, required_capabilities,
)

__all__ = ["EMBEDDING_CONVENTIONS", "ENTRIES", "KINDS", "AudioInput", "Backend", "BackendError", "Capabilities", "ImageInput",
           "CaseTimeout", "Piece", "Request", "Response", "required_capabilities"]
