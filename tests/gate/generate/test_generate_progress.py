"""``conformance generate``'s progress stage by stage (conformance/generate/progress.py): a line when each job
starts and when each of its stages ends, with the time elapsed and an estimate of the time left, and per base
the consistency it measured against its bound, the numbers of the written manifest; from the parent's own
jobs (``--workers 1``) and from local worker processes (their events come back through a queue). ``-q``
silences all of it."""

from __future__ import annotations

import json
import os
import re

import pytest

import conformance.generate.jobs as jobs
import conformance.generate.progress as progress
from conformance.cli import main
from conformance.generate import generate_set
from conformance.generate.progress import StageLog

PRESET = "31b-mini"
BASES = ("A", "B", "C", "G")
STAGES = {"A": ("forward", "consistency"), "B": ("forward", "consistency"), "C": ("forward", "consistency"),
          "G": ("continuation", "forward", "consistency")}
CONSISTENCY = re.compile(r"consistency base (\w+): chunked vs full max \|diff\| (\S+) \(bound (\S+)\) ok")
STAGE = re.compile(r"base (\w+): (continuation|forward|consistency) \d+\.\d s \(elapsed \d+\.\d s, ETA [^)]+\)")


def _check_against_manifest(lines: list[str], out) -> None:
    """Every base's stages, in order, before its consistency line and its done line; the consistency numbers
    those of the manifest (its worst agreement and each base's bound, as printed: 3 significant digits)."""
    manifest = json.loads((out / "manifest.json").read_text())
    [check] = manifest["provenance"]["cross_checks"]
    seen: dict[str, tuple[str, str]] = {}
    for b in BASES:
        mine = [line for line in lines if re.match(rf"(\[\d+/\d+\] )?(consistency )?base {b}: ", line)]
        assert mine[0].startswith(f"base {b}: started ({', '.join(STAGES[b])}")
        stages = [STAGE.fullmatch(line) for line in mine[1:1 + len(STAGES[b])]]
        assert all(stages), mine
        assert tuple(m.group(2) for m in stages) == STAGES[b]
        m = CONSISTENCY.fullmatch(mine[1 + len(STAGES[b])])
        assert m and m.group(1) == b, mine
        seen[b] = (m.group(2), m.group(3))
        assert re.fullmatch(rf"\[\d+/\d+\] base {b}: \d+ tokens, \d+ cases, \d+\.\d s", mine[-1]), mine
    assert {b: bound for b, (_, bound) in seen.items()} == {b: f"{v:.3g}" for b, v in check["bounds"].items()}
    assert max(float(diff) for diff, _ in seen.values()) == float(f"{check['agreement']:.3g}")
    assert any(diff == f"{check['agreement']:.3g}" for diff, _ in seen.values())


def test_the_command_prints_every_stage_and_the_consistency_of_the_manifest(tmp_path, capsys):
    out = tmp_path / "set"
    assert main(["generate", "--preset", PRESET, "--cases", "text", "--workers", "1", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines[0] == "[1/6] model"
    assert lines[1] == "bases to compute: A, B, C, G (in this process)"
    _check_against_manifest(lines, out)
    assert lines[-1] == "[6/6] write" and captured.out == f"wrote fixture set {out}\n"


def test_quiet_prints_nothing_but_the_result(tmp_path, capsys):
    out = tmp_path / "set"
    assert main(["generate", "--preset", PRESET, "--cases", "text", "--workers", "1", "--out", str(out), "-q"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == f"wrote fixture set {out}\n"


def test_stages_come_back_from_local_worker_processes(tmp_path):
    lines: list[str] = []
    out = generate_set(tmp_path / "w2", preset=PRESET, cases="text", workers=2, stages=lines.append,
                       progress=lambda done, total, label: lines.append(f"[{done}/{total}] {label}"))
    assert lines[1] == "bases to compute: A, B, C, G (2 local worker processes)"
    started = {m.group(1): int(m.group(2)) for m in (re.match(r"base (\w+): started \(.*\) on \S+ pid (\d+), elapsed",
                                                              line) for line in lines) if m}
    assert sorted(started) == list(BASES)
    assert os.getpid() not in started.values() and len(set(started.values())) == 2  # the two workers' own
    _check_against_manifest(lines, out)


def test_a_resumed_run_reports_the_consistency_of_the_earlier_jobs(tmp_path, monkeypatch):
    monkeypatch.setenv(jobs.FAULT_ENV, "G:fail")
    with pytest.raises(RuntimeError, match="injected failure"):
        generate_set(tmp_path / "x", preset=PRESET, cases="text", workers=1)
    monkeypatch.delenv(jobs.FAULT_ENV)
    lines: list[str] = []
    out = generate_set(tmp_path / "x", preset=PRESET, cases="text", workers=1, stages=lines.append)
    assert lines[0] == "bases to compute: G (in this process); done in an earlier run: A, B, C"
    found = {m.group(1): (m.group(2), m.group(3)) for m in map(CONSISTENCY.fullmatch, lines) if m}
    bounds = json.loads((out / "manifest.json").read_text())["provenance"]["cross_checks"][0]["bounds"]
    assert {b: bound for b, (_, bound) in found.items()} == {b: f"{v:.3g}" for b, v in bounds.items()}


def test_the_estimate_is_the_cost_left_at_the_rate_so_far(monkeypatch):
    """Two jobs of cost 10 and 30 (text, no continuation: forward and consistency half each). After 10 s with
    the first forward (5) done, 35 are left at 0.5 a second: 70 s; after the first job (10) at 20 s, 30 at 0.5."""
    now = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    lines: list[str] = []
    jobs = [{"base": b, "cost": c, "spec": {"kind": "text", "ids": [2] * 4, "greedy": 0}} for b, c in (("A", 10.0),
                                                                                                       ("B", 30.0))]
    log = StageLog(lines.append, jobs, floor=1e-9)
    log.plan(jobs, [], "in this process")
    now[0] = 110.0
    log({"base": "A", "event": "stage", "stage": "forward", "seconds": 10.0})
    assert lines[-1] == "base A: forward 10.0 s (elapsed 10.0 s, ETA 1 min 10 s)"
    now[0] = 120.0
    log.finished({"base": "A", "consistency": 2e-15, "consistency_bound": 3e-9, "rounding_probe": None})
    assert lines[-1] == "consistency base A: chunked vs full max |diff| 2e-15 (bound 3e-09) ok"
    assert log.eta() == "ETA 1 min 0 s"
    log.finished({"base": "B", "consistency": 5e-9, "consistency_bound": None})  # an earlier version's job: the floor
    assert lines[-1] == "consistency base B: chunked vs full max |diff| 5e-09 (bound 1e-09) over its bound"
