"""The grading policy of a run, in one place: which profile and which expectations grade a backend's answers,
and what they make of each case of a set.

``resolve_policy`` chooses them for every face (``conformance check``, the pytest plugin, explain): the profile
named, else the backend's ``default_profile``; the expectations given, else the file the backend ships for
its configuration (unless told not to), else none. ``Policy.decide`` is the expectations' decision on a case
(skip, known failure, tolerance overrides) and ``Policy.profile_for`` the profile the case is graded with:
the set's (``Policy.set_profile``), scaled to it (``case_profile``), then the decision's tolerance overrides on
top. A set made under an activation convention (a quantised GGUF set made with ``generate --activations``) is
graded, unless the run names a profile, with the profile of that convention (``CONVENTION_PROFILES``): its
error sources are the convention's, not the backend's default precision class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from ..sets.bounds import recorded_probes
from ..sets.case import row_groups
from .expectations import Decision, Expectations, ExpectationsError
from .expectations import load as load_expectations
from .profiles import PROFILES, Profile, scaled, with_overrides


class PolicyError(Exception):
    """A profile or expectations file a run cannot grade with. ``usage``: the caller's own argument is wrong
    (exit 2); otherwise what the backend declares is (exit 4)."""

    def __init__(self, message: str, usage: bool):
        super().__init__(message)
        self.usage = usage


# activation convention family (the part before the first "/") -> the profile its sets are graded with when
# the run names none (docs/profiles.md, "ggml-cpu")
CONVENTION_PROFILES = {"ggml-cpu": "ggml-cpu"}


@dataclass
class Policy:
    """The profile and expectations of a run (``expectations``: none by default). ``named``: the run's
    profile was named by the user (``--profile``), so it grades every set; otherwise a set made under an
    activation convention is graded with that convention's profile (``set_profile``)."""

    profile: Profile
    expectations: Expectations = field(default_factory=Expectations)
    named: bool = True

    def observe(self, sets: Iterable) -> None:
        """Tell the expectations which cases the run's sets hold (entries that match none are reported)."""
        for fs in sets:
            self.expectations.observe(c.id for c in fs.cases)

    def decide(self, case_id: str) -> Decision:
        return self.expectations.decide(case_id)

    def set_profile(self, fs) -> Profile:
        """The profile the cases of the fixture set ``fs`` are graded with before scaling: the run's, or
        when the run named none and ``fs`` was made under an activation convention, the convention's."""
        family = getattr(fs, "activations", "none").split("/")[0]
        if self.named or family not in CONVENTION_PROFILES:
            return self.profile
        return PROFILES[CONVENTION_PROFILES[family]]

    def profile_for(self, ctx, case, decision: Decision) -> Profile:
        """The profile ``case`` of the set ``ctx`` is graded with: the set's (``set_profile``), scaled to the
        set, then ``decision``'s tolerance overrides."""
        prof = case_profile(self.set_profile(ctx.fs), ctx, case)
        return with_overrides(prof, decision.tolerance) if decision.tolerance else prof


def case_profile(profile: Profile, ctx, case) -> Profile:
    """``profile`` as it grades ``case`` of the set ``ctx`` (a ``SetContext``): a rounding-scaled profile
    (exact-f64, fp32, ggml-cpu; ``profiles.scaled``) with its thresholds scaled to the set's model, the longest
    base the case reads, the largest logit scale of those bases, the largest rounding probe the set records for
    them (checkpoints that amplify rounding beyond the first-order model) and, for ggml-cpu, the largest event
    probe (what a float32 engine's one-unit roundings reach); a fixed profile, or one whose floor is above its
    rounding (every miniature), as it is."""
    if getattr(profile, "scaling", "fixed") == "fixed":
        return profile
    bases = sorted({r.base for _, rows in row_groups(case) for r in rows
                    if r.base.split("@")[0] in ctx.bases})  # an MTP base's rows: scaled by its length
    if not bases:
        return profile
    n = max(len(ctx.bases[b.split("@")[0]]) for b in bases)
    probes, event_probes = recorded_probes(ctx.fs.manifest), recorded_probes(ctx.fs.manifest, "event_probes")
    probe = max((probes[b] for b in bases if b in probes), default=None)
    events = max((event_probes[b] for b in bases if b in event_probes), default=None)
    return scaled(profile, ctx.text_config, n, max(ctx.logit_scale(b) for b in bases), probe, events)


def check_profile_name(name: str | None, flag: str = "--profile") -> None:
    """PolicyError (usage) when ``name`` is given and is no profile."""
    if name is not None and name not in PROFILES:
        raise PolicyError(f"unknown profile {name!r}; choose one of {', '.join(PROFILES)}", usage=True)


def load_given(path: str | None) -> Expectations | None:
    """The expectations file a user names (None for none); PolicyError (usage) when it cannot be read."""
    if not path:
        return None
    try:
        return load_expectations(path)
    except ExpectationsError as e:
        raise PolicyError(str(e), usage=True) from None


def resolve_policy(backend, profile: str | None = None, expectations: Expectations | None = None, *,
                   shipped: bool = True, flag: str = "--profile") -> Policy:
    """The policy a run grades ``backend`` with. ``profile``: a profile name, else the backend's
    ``default_profile``; ``expectations``: those given (``load_given``), else, when ``shipped``, the file the
    backend ships (``expectations_file``, marked ``shipped``), else none. ``flag``: the face's name of the
    profile option, for the messages. PolicyError: an unknown profile name (usage), a default profile that
    is no profile or a shipped file that cannot be read (the backend's)."""
    check_profile_name(profile, flag)
    name = profile or backend.capabilities.default_profile
    if name not in PROFILES:
        raise PolicyError(f"backend {backend.name!r} declares default_profile {name!r}, which is not a known profile "
                          f"({', '.join(PROFILES)}); pass {flag}", usage=False)
    if expectations is None and shipped and getattr(backend, "expectations_file", None) is not None:
        try:
            expectations = load_expectations(backend.expectations_file)
        except ExpectationsError as e:
            raise PolicyError(f"backend {backend.name!r} ships a broken expectations file: {e}", usage=False) from None
        expectations.shipped = True
    return Policy(PROFILES[name], expectations if expectations is not None else Expectations(),
                  named=profile is not None)
