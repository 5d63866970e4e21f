"""Conformance harness for Gemma 4 inference engines (``conformance check --backend X``).

Not implemented yet: the harness, its backends and the bundled fixtures are tracked as their own
issue and build on the oracle in ``refimpl``. This package exists so that the distribution's layout
is final; it exports nothing.
"""
