"""Running fixture sets on a backend and grading them: requests (``requests``), the one session loop
(``session``), the run (``runner``), its records (``results``), grading (``grading``, ``metrics``),
tolerance profiles (``profiles``), expectations files (``expectations``) and the policy that picks them
(``policy``). Imports ``conformance.sets``,
``conformance.protocol`` and refimpl; never ``conformance.generate``.

    from conformance.check import run, PROFILES
"""

from .expectations import Expectations, ExpectationsError
from .policy import Policy, PolicyError, resolve_policy
from .profiles import PROFILES, Profile, get_profile
from .results import FAILING, STATUSES, CaseResult, RunResult, SetInfo
from .runner import Interrupted, run, run_case, stop_signals
from .session import Checkpoints, NoCasesSelected, Selection, Session, SetContext, materialise

__all__ = ["FAILING", "PROFILES", "STATUSES", "CaseResult", "Checkpoints", "Expectations", "ExpectationsError",
           "Interrupted", "NoCasesSelected", "Policy", "PolicyError", "Profile", "RunResult", "Selection", "Session",
           "SetContext", "SetInfo", "get_profile", "materialise", "resolve_policy", "run", "run_case", "stop_signals"]
