"""How a mutant is made: ``planted`` builds the numpy engine with one hook replaced (``mutants.py`` and
``mtp_mutants.py`` define the zoo with it)."""

from __future__ import annotations

from .backend import NumpyEngineBackend
from .engine import Engine
from .mtp import DraftModel, MtpDriver

__all__ = ["MODULE", "planted"]

MODULE = "conformance.selftest.mutants"  # where every mutant class is found by name (``--backend MODULE:Class``)


def planted(name: str, breaks: str, *, engine: dict | None = None, backend: dict | None = None,
            draft: dict | None = None, driver: dict | None = None) -> type:
    """A mutant backend class: ``NumpyEngineBackend`` named ``mutant/<name>`` whose engine has the ``engine``
    hooks replaced (``Engine`` methods or attributes), whose request hooks ``backend`` replaces, and whose MTP
    drafter graph (``draft``) or round loop (``driver``) hooks are replaced. ``breaks``, one line, says what it
    breaks. The class is named after ``name`` in CamelCase and found in ``conformance.selftest.mutants``, so
    ``conformance check --backend conformance.selftest.mutants:<Class>`` runs it."""
    cls_name = "".join(part.capitalize() for part in name.split("-"))
    attrs: dict = {"name": f"mutant/{name}", "__doc__": breaks, "__module__": MODULE, **(backend or {})}
    if engine:
        attrs["engine_class"] = type(f"{cls_name}Engine", (Engine,), {"__module__": MODULE, **engine})
    if draft:  # the MTP drafter's graph (conformance/selftest/mtp.py: DraftModel)
        attrs["draft_model_class"] = type(f"{cls_name}Draft", (DraftModel,), {"__module__": MODULE, **draft})
    if driver:  # the MTP round loop (MtpDriver)
        attrs["driver_class"] = type(f"{cls_name}Driver", (MtpDriver,), {"__module__": MODULE, **driver})
    return type(cls_name, (NumpyEngineBackend,), attrs)
