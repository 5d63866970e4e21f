"""The activation convention the llama.cpp backend declares (``options.activation_convention``): the kernel path of
the machine's ggml CPU build, the K/V cache and the library's GELU; none where the oracle emulates nothing.
Needs no llama.cpp: the rule is the machine's name and the options."""

from __future__ import annotations

import pytest

from conformance.backends.llama_cpp import options


@pytest.mark.parametrize(("machine", "path"), [("x86_64", "x86"), ("AMD64", "x86"), ("aarch64", "arm"),
                                               ("arm64", "arm")])
def test_the_machine_names_the_kernel_path(monkeypatch, machine, path):
    monkeypatch.setattr(options.platform, "machine", lambda: machine)
    assert options.activation_convention("f32", False, "exact-gelu") == f"ggml-cpu/{path}"
    assert options.activation_convention("f16", False, "exact-gelu") == f"ggml-cpu/{path}/f16-kv"
    assert options.activation_convention("f16", False, "stock") == f"ggml-cpu/{path}/f16-kv/gelu-table"
    assert options.activation_convention("f32", True, "stock") == "none"  # flash attention: fp16 accumulators
    assert options.activation_convention("f32", False, "custom") == "none"  # a library directory of unknown build


def test_other_machines_follow_no_convention(monkeypatch):
    for machine in ("ppc64le", "riscv64", "s390x", ""):
        monkeypatch.setattr(options.platform, "machine", lambda machine=machine: machine)
        assert options.activation_convention("f32", False, "stock") == "none", machine
