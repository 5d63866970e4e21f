"""Fixtures shared by the rooms of tests/ (tests/oracle/, tests/gate/); a fixture that one room alone uses is
in that room's conftest.py (tests/gate/conftest.py: ``oracle_bases``; tests/gate/cli/conftest.py: ``e2b_mini``;
tests/gate/backends/transformers/conftest.py: torch on one thread). Support modules (helpers.py, naive_gemma4.py,
hf_reference.py, hf_towers.py, ...) sit beside this file, which puts tests/ on ``sys.path``.

* ``preset_dirs``   (session): every preset of ``refimpl.synth.PRESETS`` written once (seed 0, F32),
  as ``{preset: path}``.
* ``preset_models`` (session): ``{preset: Gemma4(path)}`` in float64, exact embedding scale. The
  model holds no per-call state (the KV cache is passed in), so one instance serves every test.
* ``micro_factory`` (session): ``micro_factory(config_dict, seed) -> path``, a fresh directory per
  call; safe inside hypothesis tests (it is not function-scoped).
* ``micro_checkpoint`` / ``micro_config`` are re-exported from ``tests/helpers.py`` for direct use.
* ``torch_one_thread`` (module): torch, transformers' modeling_gemma4 and hf_reference, torch on one thread.
* hypothesis profiles: ``ci`` (the default: each test's own budget, ``helpers.examples``) and ``deep``
  (``pytest --hypothesis-profile deep``: ten times each budget).
* ``digest_cache`` (session, autouse): ``$CONFORMANCE_CACHE_DIR`` set to a temporary directory, so the
  checkpoint digest cache of the tests is never the user's.

``GEMMA4_CONFORMANCE_REQUIRE_ENGINES=1`` (set by ``.ci/run``) turns the skips of the real-engine
test modules (an engine or the llama.cpp build missing) into failures, so CI cannot pass with the
engines silently untested.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import micro_checkpoint, micro_config  # noqa: F401 - for the tests that import them from here

from refimpl.model import Gemma4
from refimpl.synth import PRESETS, write_checkpoint

settings.register_profile("ci", deadline=None)  # each test's budget: helpers.examples(n)
settings.register_profile("deep", deadline=None, max_examples=1000)  # ten times each budget
settings.load_profile("ci")


@pytest.fixture(scope="session", autouse=True)
def digest_cache(tmp_path_factory):
    """The checkpoint digest cache (conformance.sets.checkpoint) of the whole session, in a temporary
    directory: tests never read or write the user's ~/.cache. Child processes inherit it."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("digest-cache")
        mp.setenv("CONFORMANCE_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="session")
def preset_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("presets")
    return {preset: write_checkpoint(preset, 0, root / preset, dtype="f32") for preset in PRESETS}


@pytest.fixture(scope="session")
def preset_models(preset_dirs) -> dict[str, Gemma4]:
    return {preset: Gemma4(path) for preset, path in preset_dirs.items()}


@pytest.fixture(scope="session")
def micro_factory(tmp_path_factory):
    root = tmp_path_factory.mktemp("micro")
    counter = itertools.count()

    def make(config_dict: dict, seed: int = 0, **kwargs) -> Path:
        return micro_checkpoint(root / f"m{next(counter)}", config_dict, seed, **kwargs)

    return make


@pytest.fixture(scope="module")
def torch_one_thread():
    """(torch, modeling_gemma4, hf_reference) with torch on one thread for the module (tiny models:
    threads only add overhead on a busy 2-core box); skips without torch and transformers."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import hf_reference
    import transformers.models.gemma4.modeling_gemma4 as mg

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield torch, mg, hf_reference
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------------
# CI: an engine that is not installed fails instead of skipping

ENGINE_TEST_MODULES = ("test_transformers_backend.py", "test_mlx_lm_backend.py", "test_mlx_vlm_backend.py",
                       "test_llama_cpp_backend.py", "test_traces_transformers.py", "test_traces_mlx_lm.py",
                       "test_traces_llama_cpp.py", "test_hf_agreement.py",
                       "test_parallel_generate.py", "test_generation_faults.py",  # these two: Dask distributed
                       "test_gguf_llama_cpp.py", "test_openai_server.py")
MISSING_ENGINE_REASONS = ("not installed", "could not import", "No module named", "missing", "exact-GELU")


def _engines_required(path) -> bool:
    return (os.environ.get("GEMMA4_CONFORMANCE_REQUIRE_ENGINES") == "1"
            and Path(str(path)).name in ENGINE_TEST_MODULES)


def _fail_instead(report, what: str) -> None:
    report.outcome = "failed"
    report.longrepr = (f"GEMMA4_CONFORMANCE_REQUIRE_ENGINES=1, but {what} was skipped: {report.longrepr}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _engines_required(getattr(collector, "path", "")):
        _fail_instead(report, f"the module {collector.path.name}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _engines_required(item.path) and any(r in str(report.longrepr)
                                                                for r in MISSING_ENGINE_REASONS):
        _fail_instead(report, item.nodeid)
