"""The subprocess protocol's two ends in Python: ``client`` (the ``subprocess`` backend, which drives any
engine in another process, restarting it after a crash or a timeout; ``IsolatedBackend`` for
``--isolate``), one engine process (``process``), and the reference ``server``. The wire format itself
is ``conformance.protocol.wire``."""

from .client import IsolatedBackend, RefimplSubprocessBackend, SubprocessBackend

__all__ = ["IsolatedBackend", "RefimplSubprocessBackend", "SubprocessBackend"]
