"""Old import path of the backend protocol types: ``conformance.protocol`` (kept so that backends written
against ``from conformance.backend import ...`` keep working; see docs/architecture.md, "Migration")."""

from conformance.protocol.types import *  # noqa: F401,F403
from conformance.protocol.types import (  # noqa: F401
    EMBEDDING_CONVENTIONS, ENTRIES, KINDS, AudioInput, Backend, BackendError, Capabilities, CaseTimeout, Piece,
    Request, Response, required_capabilities,
)
