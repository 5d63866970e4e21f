"""Old path of the reference server: ``python -m conformance.serve`` (the command) and
``conformance.backends.subprocess.server`` (``handle``, ``serve``). ``python -m conformance.backends.protocol_server``
still works: run as a script, it hands over to the command."""

from ..protocol.wire import jsonable, request_from_json, write_array
from ..protocol.wire import read_input_array as read_raw
from .subprocess.server import handle, serve

__all__ = ["handle", "jsonable", "read_raw", "request_from_json", "serve", "write_array"]

if __name__ == "__main__":
    import runpy

    runpy.run_module("conformance.serve", run_name="__main__")
