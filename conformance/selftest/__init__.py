"""The gate's self-test: ``engine`` (numpy-engine, a second NumPy backend organised like a production
engine), ``mutants`` (the engine with one known bug planted, one factory), ``run`` (``run_selftest``: the
control, then every mutant, graded; which check catches which bug), ``results`` (its records) and ``output`` (its
table, console summary and JSON). Imports ``conformance.check``,
``conformance.report`` and below.

    from conformance.selftest import run_selftest, MUTANTS
"""

from .backend import NumpyEngineBackend
from .mutants import EQUIVALENT, MUTANTS, Mutant
from .output import console_summary, format_table, table_rows, to_json, write_json
from .results import (
    CONTROL_PROFILE,
    DEFAULT_PROFILES,
    SCHEMA,
    SCHEMA_VERSION,
    ControlResult,
    MutantResult,
    SelftestResult,
    Verdict,
)
from .run import (
    default_control,
    load_equivalents,
    load_mutants,
    load_rewrites,
    run_selftest,
    select_equivalents,
    select_mutants,
)

__all__ = ["CONTROL_PROFILE", "DEFAULT_PROFILES", "EQUIVALENT", "MUTANTS", "SCHEMA", "SCHEMA_VERSION", "ControlResult",
           "Mutant", "MutantResult", "NumpyEngineBackend", "SelftestResult", "Verdict", "console_summary",
           "default_control", "load_equivalents", "load_mutants", "load_rewrites", "run_selftest", "select_equivalents",
           "select_mutants", "format_table", "table_rows", "to_json", "write_json"]
