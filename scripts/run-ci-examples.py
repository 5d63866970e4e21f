#!/usr/bin/env python3
"""Run the commands of the CI examples (examples/) locally, so that they are tested, not just written.

    scripts/run-ci-examples.py [github-actions] [gitlab-ci] [docker] [--keep] [--args "CHECK ARGS"]

Each example runs in a fresh temporary directory, in a fresh clone of this checkout's committed HEAD (what a
CI job checks out), under bash with `set -euo pipefail`, one step after another:

* github-actions: every `run:` step of examples/github-actions/conformance.yml with the job's `env:`
  (`${{ github.workspace }}` is the clone); the `uses:` steps are the runner's (checkout: the clone;
  setup-python: this machine's python3; cache, upload-artifact, the JUnit report action: not run, their
  inputs checked instead: the reports exist, the JUnit parses). `GITHUB_STEP_SUMMARY` is a file, which must
  hold the Markdown summary afterwards.
* gitlab-ci: the job's `script:` lines with its `variables:` (`$CI_PROJECT_DIR` is the clone); the
  `artifacts:` paths must exist afterwards.
* docker: the Dockerfile's `RUN` lines with its `ARG` defaults (`COPY . .` is the clone, `/opt/venv` a venv in
  the temporary directory; the apt-get line is skipped: this machine's packages stand in for the image's).

The examples' sources of the gate are replaced by this clone (CONFORMANCE_SOURCE, CONFORMANCE_CONSTRAINTS,
TORCH_INDEX emptied), and `--args` (default: one fixture set's cases, `--match ^e2b-mini/`) goes to
CONFORMANCE_ARGS so that a local run takes a minute. A step that fails fails the example; the exit code is
the number of failed examples. Needs PyYAML (the test extras bring it through transformers).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = ("github-actions", "gitlab-ci", "docker")


def _yaml(path: Path):
    try:
        import yaml
    except ImportError:
        sys.exit("run-ci-examples: needs PyYAML (pip install pyyaml)")
    return yaml.safe_load(path.read_text())


def _bash(script: str, cwd: Path, env: dict[str, str], what: str) -> None:
    print(f"--- {what}", flush=True)
    print("\n".join(f"    {line}" for line in script.strip().splitlines()), flush=True)
    t = time.perf_counter()
    proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], cwd=cwd, env=env)
    print(f"    -> exit {proc.returncode} in {time.perf_counter() - t:.1f} s", flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what}: exit {proc.returncode}")


def _clone(tmp: Path) -> Path:
    work = tmp / "work"
    subprocess.run(["git", "clone", "-q", str(REPO), str(work)], check=True)
    return work


def _base_env(tmp: Path, work: Path, args: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "GITHUB_", "CI_"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    return {**env, "HOME": env.get("HOME", str(tmp)), "CONFORMANCE_ARGS": args}


def _gate(env: dict[str, str], work: Path) -> dict[str, str]:
    """The example's sources of the gate, pointed at the clone."""
    return {**env, "CONFORMANCE_SOURCE": str(work), "CONFORMANCE_CONSTRAINTS": str(work / "constraints/engines.txt")}


def _expand(value: str, names: dict[str, str]) -> str:
    return re.sub(r"\$\{\{\s*([\w.]+)\s*\}\}", lambda m: names.get(m.group(1), m.group(0)), value)


def github_actions(tmp: Path, work: Path, args: str) -> None:
    wf = _yaml(REPO / "examples/github-actions/conformance.yml")
    (job,) = wf["jobs"].values()
    env = _base_env(tmp, work, args)
    names = {"github.workspace": str(work), "runner.os": "Linux"}
    env.update({k: _expand(str(v), names) for k, v in (job.get("env") or {}).items()})
    env = _gate(env, work)
    env["CONFORMANCE_ARGS"] = args
    summary = tmp / "step-summary.md"
    summary.write_text("")
    env["GITHUB_STEP_SUMMARY"], env["GITHUB_ACTIONS"] = str(summary), "true"
    for step in job["steps"]:
        if "run" in step:
            _bash(_expand(step["run"], names), work, env, f"github-actions: {step.get('name', step['run'][:40])}")
        else:
            print(f"--- github-actions: uses {step['uses']} (the runner's; not run here)", flush=True)
    _check_reports(work)
    text = summary.read_text()
    if "Gemma 4 conformance" not in text or "| entry point |" not in text:
        raise RuntimeError("github-actions: $GITHUB_STEP_SUMMARY holds no Markdown summary")
    print(f"    the job summary: {len(text)} characters, first line {text.splitlines()[0]!r}")


def gitlab_ci(tmp: Path, work: Path, args: str) -> None:
    doc = _yaml(REPO / "examples/gitlab-ci/.gitlab-ci.yml")
    job = doc["conformance"]
    env = {**_base_env(tmp, work, args), "CI_PROJECT_DIR": str(work)}
    for k, v in (job.get("variables") or {}).items():
        env[k] = os.path.expandvars(str(v).replace("$CI_PROJECT_DIR", str(work)))
    env = _gate(env, work)
    env["CONFORMANCE_ARGS"] = args
    _bash("\n".join(job["script"]), work, env, "gitlab-ci: script")
    for path in job["artifacts"]["paths"] + [job["artifacts"]["reports"]["junit"]]:
        if not (work / path).exists():
            raise RuntimeError(f"gitlab-ci: the artifact {path} was not written")
    _check_reports(work)


def docker(tmp: Path, work: Path, args: str) -> None:
    lines = (REPO / "examples/docker/Dockerfile").read_text().replace("\\\n", " ").splitlines()
    env = _base_env(tmp, work, args)
    venv = tmp / "venv"
    steps = []
    for line in lines:
        word, _, rest = line.strip().partition(" ")
        if word == "ARG":
            name, _, default = rest.partition("=")
            env[name] = shlex.split(default)[0] if default else ""
        elif word == "RUN" and not rest.startswith("apt-get"):
            steps.append(rest.replace("/opt/venv", str(venv)))
    env["TORCH_INDEX"] = ""  # no other index here
    for run in steps:
        _bash(run, work, env, "docker: RUN")


def _check_reports(work: Path) -> None:
    """What the upload and JUnit-report steps would read: the three reports, the JUnit parsed."""
    import xml.etree.ElementTree as ET

    for name in ("conformance.json", "conformance.xml", "summary.md"):
        if not (work / "reports" / name).is_file():
            raise RuntimeError(f"reports/{name} was not written")
    root = ET.parse(work / "reports/conformance.xml").getroot()
    print(f"    reports/conformance.xml: {root.get('tests')} tests, {root.get('failures')} failures, "
          f"{root.get('errors')} errors")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("examples", nargs="*", metavar="EXAMPLE", help=f"any of {', '.join(EXAMPLES)} (default: all)")
    parser.add_argument("--args", default="--match ^e2b-mini/", help="CONFORMANCE_ARGS of the examples' check")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directories")
    a = parser.parse_args(argv)
    unknown = [e for e in a.examples if e not in EXAMPLES]
    if unknown:
        parser.error(f"unknown example(s) {', '.join(unknown)}; choose from {', '.join(EXAMPLES)}")
    failed = []
    for name in a.examples or EXAMPLES:
        tmp = Path(tempfile.mkdtemp(prefix=f"ci-example-{name}-"))
        print(f"=== {name} in {tmp}", flush=True)
        t = time.perf_counter()
        try:
            work = _clone(tmp)
            {"github-actions": github_actions, "gitlab-ci": gitlab_ci, "docker": docker}[name](tmp, work, a.args)
            print(f"=== {name}: green in {time.perf_counter() - t:.0f} s", flush=True)
        except (RuntimeError, subprocess.CalledProcessError) as e:
            print(f"=== {name}: FAILED: {e}", flush=True)
            failed.append(name)
        finally:
            if not a.keep:
                subprocess.run(["rm", "-rf", str(tmp)])
    print(f"{len(a.examples or EXAMPLES) - len(failed)} passed, {len(failed)} failed")
    return len(failed)


if __name__ == "__main__":
    sys.exit(main())
