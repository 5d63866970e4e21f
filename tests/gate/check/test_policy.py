"""The grading policy (conformance/check/policy.py): one resolution of profile and expectations for every face.

``resolve_policy`` against its rules; the faces agree: ``conformance check`` and the pytest plugin report the same
expectations of the same shipped file (the plugin read a shipped file as a user's before, and reported the
entries for the other bundled sets as matching no case), and explain refuses a backend's unknown default profile
as check does (it raised a KeyError before)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.backends.refimpl_backend import RefimplBackend
from conformance.check.policy import Policy, PolicyError, case_profile, load_given, resolve_policy
from conformance.check.profiles import PROFILES
from conformance.check.session import Checkpoints
from conformance.cli import main
from conformance.protocol.types import Capabilities
from conformance.sets import bundled_set, load_set

ROOT = Path(__file__).resolve().parents[3]
HERE = __name__


class ShipsExpectations(RefimplBackend):
    """The oracle, shipping an expectations file for its configuration."""

    def __init__(self, expectations_file: str):
        super().__init__()
        self.expectations_file = Path(expectations_file)


class UnknownDefault(RefimplBackend):
    """The oracle, declaring a default profile that is none."""

    def __init__(self):
        super().__init__()
        self.name = "unknown-default"
        self.capabilities = Capabilities(**{**self.capabilities.to_dict(), "default_profile": "nope"})


def _file(tmp_path: Path, name: str, entries: list[dict]) -> str:
    path = tmp_path / name
    path.write_text(json.dumps({"entries": entries}), encoding="utf-8")
    return str(path)


SHIPPED = [{"match": "/full/", "action": "known-failure", "reason": "row 0"},
           {"match": "e4b-mini/last", "action": "skip", "reason": "another set's entry"}]


def test_resolve_policy_follows_its_rules(tmp_path):
    shipped = _file(tmp_path, "shipped.json", SHIPPED)
    backend = ShipsExpectations(shipped)
    p = resolve_policy(backend)
    assert p.profile is PROFILES[backend.capabilities.default_profile]
    assert p.expectations.shipped and p.expectations.path == shipped and len(p.expectations.entries) == 2
    assert resolve_policy(backend, "q8").profile is PROFILES["q8"]
    assert resolve_policy(backend, shipped=False).expectations.entries == []
    given = load_given(_file(tmp_path, "mine.json", SHIPPED[:1]))
    mine = resolve_policy(backend, expectations=given).expectations
    assert mine is given and not mine.shipped  # the user's file replaces the shipped one
    assert resolve_policy(RefimplBackend()).expectations.entries == []
    with pytest.raises(PolicyError) as e:
        resolve_policy(backend, "q9")
    assert e.value.usage and str(e.value) == f"unknown profile 'q9'; choose one of {', '.join(PROFILES)}"
    with pytest.raises(PolicyError) as e:
        resolve_policy(UnknownDefault(), flag="--conformance-profile")
    assert not e.value.usage and str(e.value) == (
        f"backend 'unknown-default' declares default_profile 'nope', which is not a known profile "
        f"({', '.join(PROFILES)}); pass --conformance-profile")
    with pytest.raises(PolicyError) as e:
        resolve_policy(ShipsExpectations(_file(tmp_path, "broken.json", [{"match": "x", "action": "skip"}])))
    assert not e.value.usage and str(e.value).startswith("backend 'refimpl' ships a broken expectations file: ")
    with pytest.raises(PolicyError) as e:
        load_given(str(tmp_path / "missing.json"))
    assert e.value.usage


def test_a_case_is_graded_with_the_scaled_profile_and_then_its_overrides(tmp_path):
    """Policy.profile_for: the set's scaling first (exact-f64 follows the model; here the published E2B config in
    the miniature's place, so that the scaling moves max_abs), then the expectations entry's tolerance on top:
    the overridden field takes the entry's value, the others keep the scaled ones; a fixed profile is not
    scaled; a case no entry names is graded with the scaled profile alone."""
    from helpers import e2b_config

    fs = load_set(bundled_set("e2b-mini"))
    ctx = Checkpoints(tmp_path).context(fs, "scaled")
    ctx.__dict__["text_config"] = e2b_config()
    case, other = [c for c in fs.cases if c.base == "A"][:2]
    entry = {"match": f"^{re.escape(case.id)}$", "action": "tolerance", "reason": "looser", "tolerance": {"nmse": 0.5}}
    policy = Policy(PROFILES["exact-f64"], load_given(_file(tmp_path, "t.json", [entry])))
    policy.observe([fs])
    scaled = case_profile(PROFILES["exact-f64"], ctx, case)
    assert scaled.max_abs != PROFILES["exact-f64"].max_abs  # the scaling did move it
    got = policy.profile_for(ctx, case, policy.decide(case.id))
    assert got.nmse == 0.5 and got.max_abs == scaled.max_abs and got.kl_max == scaled.kl_max
    assert got.sources[:-1] == scaled.sources and "nmse" in got.sources[-1]
    assert policy.profile_for(ctx, other, policy.decide(other.id)) == case_profile(PROFILES["exact-f64"], ctx, other)
    assert Policy(PROFILES["q8"]).profile_for(ctx, case, policy.decide(case.id)).max_abs == PROFILES["q8"].max_abs


def _plugin(tmp_path: Path, *args: str) -> tuple[int, str]:
    here = [str(Path(__file__).resolve().parent), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(here))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-c", "pytest.ini", "--rootdir",
                          str(tmp_path), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    return run.returncode, run.stdout + run.stderr


def test_check_and_the_plugin_report_the_same_expectations(tmp_path, capsys):
    """The same shipped file, the same set and selection: the two faces' JSON reports hold the same expectations
    record (the entry for e4b-mini counted for another set, not reported as matching no case) and the same
    statuses."""
    shipped = _file(tmp_path, "shipped.json", SHIPPED)
    fixtures = str(ROOT / "fixtures" / "e2b-mini")
    assert main(["check", "--backend", f"{HERE}:ShipsExpectations", "--backend-option", f"expectations_file={shipped}",
                 "--fixtures", fixtures, "-k", "full", "-q", "--json", str(tmp_path / "check.json")]) == 1
    capsys.readouterr()
    rc, out = _plugin(tmp_path, "--conformance-backend", f"{HERE}:ShipsExpectations", "--conformance-backend-option",
                      f"expectations_file={shipped}", "--conformance-fixtures", fixtures, "-k", "full", "-q",
                      "--conformance-json", str(tmp_path / "plugin.json"))
    assert rc == 1, out
    check, plugin = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("check", "plugin"))
    assert check["expectations"]["for_other_sets"] == 1 and check["expectations"]["unused"] == []
    assert plugin["expectations"] == check["expectations"]
    assert ({c["id"]: c["status"] for c in plugin["cases"]} == {c["id"]: c["status"] for c in check["cases"]}
            == {c["id"]: "xpass" for c in check["cases"]})


def test_explain_refuses_an_unknown_default_profile_as_check_does(tmp_path, capsys):
    fixtures = str(ROOT / "fixtures" / "e2b-mini")
    said = {}
    for command in ("check", "explain"):
        assert main([command, "--backend", f"{HERE}:UnknownDefault", "--fixtures", fixtures, "-k", "full", "-q"]) == 4
        said[command] = capsys.readouterr().err
    assert said["explain"] == said["check"] == (
        f"conformance: error: backend 'unknown-default' declares default_profile 'nope', which is not a known profile "
        f"({', '.join(PROFILES)}); pass --profile\n")


def test_a_set_made_under_an_activation_convention_has_the_convention_s_profile(tmp_path):
    """Policy.set_profile: the bundled GGUF Q4_K_M set (made under ggml-cpu/x86/f16-kv/gelu-table) is graded
    with ggml-cpu when the run names no profile (resolve_policy without one: named False), with the named profile
    otherwise; a set made under no convention keeps the run's profile either way, and so does a policy built
    directly (named by default)."""
    q4km, plain = load_set(bundled_set("e2b-256-mini-q4km")), load_set(bundled_set("e2b-256-mini"))
    assert q4km.activations == "ggml-cpu/x86/f16-kv/gelu-table" and plain.activations == "none"
    default = resolve_policy(RefimplBackend())
    named = resolve_policy(RefimplBackend(), "fp32")
    assert not default.named and named.named
    assert default.set_profile(q4km) is PROFILES["ggml-cpu"] and default.set_profile(plain) is default.profile
    assert named.set_profile(q4km) is PROFILES["fp32"] and named.set_profile(plain) is PROFILES["fp32"]
    assert Policy(PROFILES["q8"]).set_profile(q4km) is PROFILES["q8"]
    ctx = Checkpoints(tmp_path).context(q4km, "scaled")
    case = q4km.cases[0]
    assert default.profile_for(ctx, case, default.decide(case.id)) is PROFILES["ggml-cpu"]
