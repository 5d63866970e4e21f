"""Backends shipped with the harness."""
