"""Old import path of the request handling shared by cache-based backends: ``conformance.protocol.serving``."""

from ..protocol.serving import CachedBackend, check_multi, micro_batches, per_sequence

__all__ = ["CachedBackend", "check_multi", "micro_batches", "per_sequence"]
