"""The layout of docs/architecture.md, held against the code: imports point only downwards, check and
generate never import each other, refimpl imports nothing of conformance, imports sit at module top (the
optional heavy engines aside), no module takes another's private names, modules stay readable in one
sitting, and the wheel's package list is the tree's.

The imports are read with ``ast`` from the source (nothing is imported), so a violation names the file
and the line.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# the tiers, lowest first: a module may import its own tier's packages only where allowed below
TIERS = [
    ("refimpl",),
    ("conformance.protocol",),
    ("conformance.sets",),
    ("conformance.check", "conformance.generate", "conformance.report"),
    ("conformance.backends",),
    ("conformance.selftest",),
    # explain re-runs cases on a backend and the oracle (its own self-test reads the mutants); loss compares a
    # quantised set with its reference, and a backend with both
    ("conformance.explain", "conformance.loss"),
    ("conformance.registry",),  # a face, below the others: it finds backends for all of them
    ("conformance.cli", "conformance.serve", "conformance.pytest_plugin", "conformance.compat"),
]
# within the third tier only report reads check (its result records); check and generate never meet
SIDEWAYS = {("conformance.report", "conformance.check")}
# imports that may stay inside a function: optional heavy engines, imported only when used
LAZY_OK = {"torch", "transformers", "mlx", "mlx_lm", "llama_cpp", "distributed", "dask", "jinja2", "matplotlib",
           "PIL", "runpy"}
# modules over about 600 lines, and why (docs/architecture.md says the same)
LONG_OK = {
    "conformance/selftest/engine.py": "the numpy engine is one production-style engine; its hooks are the mutants' API",
    "conformance/backends/transformers/backend.py": "transformers: loading, the cache driver and the multimodal path",
}
MAX_LINES = 600
MAX_FUNCTION_LINES = 80


def modules() -> list[tuple[str, Path]]:
    out = []
    for root in ("refimpl", "conformance"):
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.append((".".join(parts), path))
    return out


def tier(name: str) -> tuple[int, str] | None:
    for rank, packages in enumerate(TIERS):
        for pkg in packages:
            if name == pkg or name.startswith(pkg + "."):
                return rank, pkg
    return None


def imports(module: str, path: Path) -> list[tuple[str, list[str], int, bool]]:
    """(imported module, names, line, at module level) for every import of the file, relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top = {id(n) for n in tree.body}
    for node in tree.body:  # an import under `if __name__ == "__main__":` or `try:` at module level is top-level
        if isinstance(node, (ast.If, ast.Try)):
            top |= {id(n) for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((target, [a.name for a in node.names], node.lineno, id(node) in top))
    return out


ALL = modules()


def test_imports_point_only_downwards():
    bad = []
    for name, path in ALL:
        mine = tier(name)
        if mine is None:
            continue
        for target, _, line, _ in imports(name, path):
            theirs = tier(target)
            if theirs is None or theirs[1] == mine[1]:
                continue
            if theirs[0] > mine[0] or (theirs[0] == mine[0] and (mine[1], theirs[1]) not in SIDEWAYS):
                bad.append(f"{path.relative_to(REPO)}:{line}: {name} imports {target}")
    assert bad == []


def test_refimpl_imports_nothing_of_conformance():
    bad = [f"{path.relative_to(REPO)}:{line}" for name, path in ALL if name.startswith("refimpl")
           for target, _, line, _ in imports(name, path) if target.split(".")[0] == "conformance"]
    assert bad == []


def test_sets_hold_the_format_only():
    """conformance/sets/ reads and checks sets; it builds no model and writes no checkpoint: the oracle
    (refimpl.model, refimpl.assistant) is handed in by the caller, and a synthetic checkpoint is regenerated by
    the side that needs it (conformance.check.materialise, generate's recompute)."""
    building = {"refimpl.model", "refimpl.assistant", "refimpl.synth", "refimpl.weights"}
    bad = [f"{path.relative_to(REPO)}:{line}: {target}" for name, path in ALL if name.startswith("conformance.sets")
           for target, _, line, _ in imports(name, path) if target in building]
    assert bad == []


def test_imports_sit_at_module_top():
    bad = [f"{path.relative_to(REPO)}:{line}: {target}" for name, path in ALL
           for target, _, line, top in imports(name, path)
           if not top and target.split(".")[0] not in LAZY_OK]
    assert bad == []


def test_no_module_takes_another_modules_private_names():
    bad = []
    for name, path in ALL:
        for target, names, line, _ in imports(name, path):
            if target.split(".")[0] not in ("refimpl", "conformance") or target == name:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and target.rpartition(".")[0] != name.rpartition(".")[0]:
                bad.append(f"{path.relative_to(REPO)}:{line}: {', '.join(private)} from {target}")
    assert bad == []


def test_no_import_circle():
    graph: dict[str, set[str]] = {}
    names = {n for n, _ in ALL}
    for name, path in ALL:
        deps = set()
        for target, imported, _, top in imports(name, path):
            if not top:
                continue
            for cand in [f"{target}.{n}" for n in imported] + [target]:
                if cand in names and cand != name:
                    deps.add(cand)
                    break
        graph[name] = deps
    seen: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(n: str, trail: list[str]) -> list[str] | None:
        seen[n] = 1
        for d in sorted(graph.get(n, ())):
            if d.startswith(n + "."):  # a package importing its own submodules in __init__ is no circle
                continue
            if seen.get(d) == 1 and not n.startswith(d + "."):
                return trail + [n, d]
            if d not in seen:
                found = visit(d, trail + [n])
                if found:
                    return found
        seen[n] = 2
        return None

    for n in sorted(graph):
        if n not in seen:
            assert visit(n, []) is None


def test_modules_are_readable_in_one_sitting():
    long = {str(path.relative_to(REPO)): len(path.read_text(encoding="utf-8").splitlines()) for _, path in ALL}
    over = {p: n for p, n in long.items() if n > MAX_LINES}
    assert set(over) == set(LONG_OK), over


def test_functions_are_readable_in_one_sitting():
    """Every function of refimpl/ and conformance/ is at most MAX_FUNCTION_LINES long (its def to its last line)."""
    over = {}
    for _, path in ALL:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    over[f"{path.relative_to(REPO)}:{node.name}"] = n
    assert over == {}  # no exception: split a longer function by its steps


def test_the_wheel_lists_every_package_of_the_tree():
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    listed = set(config["packages"])
    tree = {".".join(p.relative_to(REPO).parts[:-1]) for root in ("refimpl", "conformance")
            for p in (REPO / root).rglob("__init__.py")}
    assert listed - {"conformance.bundled"} == tree
    assert config["package-dir"] == {"conformance.bundled": "fixtures"}
    assert (REPO / "fixtures").is_dir() and not (REPO / "fixtures" / "__init__.py").exists()  # data only


COMPAT = __import__("conformance.compat").compat


def _import_old(old: str, then: str) -> list[str]:
    """Import an old module in a fresh interpreter (no cached import hides the warning): the warning's text,
    then what ``then`` prints with the module as ``m``."""
    code = ("import importlib, sys, warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            f"try:\n    importlib.import_module({old!r})\nexcept DeprecationWarning as w:\n    print(w)\n"
            f"warnings.simplefilter('ignore')\nm = importlib.import_module({old!r})\n{then}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@pytest.mark.parametrize("old", sorted(COMPAT.OLD_MODULES))
def test_a_moved_module_is_its_new_module_with_a_warning(old):
    """conformance.compat: the old name imports the new module itself, and says where it went
    (DeprecationWarning naming the new path)."""
    new = COMPAT.OLD_MODULES[old]
    if old.endswith(("transformers_backend", "mlx_backend")):
        pytest.importorskip("torch" if "transformers" in old else "mlx.core")
    assert _import_old(old, f"print(m is importlib.import_module({new!r}))") == [
        f"{old} is an old import path: import {new} instead (docs/architecture.md, 'Migration')", "True"]


@pytest.mark.parametrize("old, new", [
    ("conformance.fixtures", "conformance.sets or conformance.generate"),
    ("conformance.backends.subprocess_backend", "conformance.protocol.wire or conformance.backends.subprocess.client"),
    ("conformance.backends.protocol_server", "conformance.backends.subprocess.server or conformance.protocol.wire"),
])
def test_a_split_module_holds_the_same_objects_with_a_warning(old, new):
    """A module whose names went to several modules: each old name is the very object of its new home, and the
    import names every new home."""
    table = COMPAT.SPLIT_MODULES[old]
    check = ("import importlib\n"
             f"for name, target in {table!r}.items():\n"
             "    where, attr = target.split(':')\n"
             "    assert getattr(m, name) is getattr(importlib.import_module(where), attr), name\n"
             "print(sorted(m.__all__) == sorted(" + repr(list(table)) + "))")
    assert _import_old(old, check) == [
        f"{old} is an old import path: import {new} instead (docs/architecture.md, 'Migration')", "True"]


def test_an_old_command_runs_its_new_one_with_a_warning():
    """``python -m conformance.backends.protocol_server`` still serves (through ``python -m conformance.serve``):
    a hello answered on stdout, the warning on stderr."""
    hello = json.dumps({"id": 0, "op": "hello", "protocol": "gemma4-conformance-subprocess", "versions": [1]})
    out = subprocess.run([sys.executable, "-m", "conformance.backends.protocol_server", "--backend", "refimpl"],
                         input=hello + "\n", capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[0])["ok"] is True
    assert ("DeprecationWarning: python -m conformance.backends.protocol_server is an old command: run python -m "
            "conformance.serve instead (docs/architecture.md, 'Migration')") in out.stderr


def test_bundled_sets_are_found_from_the_source_tree():
    from conformance.sets import bundled_sets

    found = bundled_sets()
    assert [p.parent for p in found] == [REPO / "fixtures"] * len(found) and len(found) == 16
    assert sys.modules["conformance.sets.bundled"].bundle_root() == REPO / "fixtures"


def test_a_wheel_of_the_tree_ships_the_bundled_sets_and_finds_them(tmp_path):
    """The wheel (built here without build isolation) holds the bundled sets as conformance/bundled/<set>/ and
    every data file; unpacked outside the source tree, ``bundled_sets`` finds them there and they load."""
    import subprocess
    import zipfile

    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} cannot build this project (needs >= 77)")
    out = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(REPO),
                    "-w", str(out)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = out.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sets = sorted(p.name for p in (REPO / "fixtures").iterdir() if (p / "manifest.json").is_file())
    for s in sets:
        files = ["manifest.json", *json.loads((REPO / "fixtures" / s / "manifest.json").read_text())["files"]]
        assert {f"conformance/bundled/{s}/{f}" for f in files} <= names
    data = [p.relative_to(REPO / "conformance").as_posix() for p in (REPO / "conformance").rglob("*.json")]
    assert data and all(f"conformance/{d}" in names for d in data)
    assert not any(n.startswith(("fixtures/", "tests/")) for n in names)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from conformance.sets import bundled_sets, load_set; "
            "found = bundled_sets(); print(len(found), found[0].parent, sum(len(load_set(p).cases) for p in found))")
    got = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    n, root, cases = got.stdout.split()
    assert (int(n), root, int(cases)) == (len(sets), str(site / "conformance" / "bundled"), 814)
    # the MLX quantised set ships its checkpoint (scripts/bundle-mlx-set.py): every recorded file is in the wheel
    assert {f"conformance/bundled/e2b-mini-mlx-q4/checkpoint/{f}" for f in
            ("config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.model")} <= set(names)


def test_paths_computed_from_a_module_location_point_into_the_checkout():
    """A module that moved deeper must not lose its way to the checkout (the llama.cpp sources and builds
    under .cache/, the directory put on the engine child's PYTHONPATH), nor to the data beside it."""
    from conformance.backends.llama_cpp import backend, library, options
    from conformance.report import SCHEMA_PATH

    assert library.REPO_ROOT == REPO and library.DEFAULT_SOURCE.is_relative_to(REPO / ".cache" / "llama-cpp")
    assert library.EXACT_GELU_LIB.is_relative_to(REPO / ".cache" / "llama-cpp")
    assert options.EXPECTATIONS_DIR == REPO / "conformance" / "backends" / "llama_cpp" / "expectations"
    assert any(options.EXPECTATIONS_DIR.glob("*.json")) and SCHEMA_PATH.is_file()
    assert (backend.PACKAGE_ROOT / "conformance" / "__init__.py").is_file()  # what the engine child imports
