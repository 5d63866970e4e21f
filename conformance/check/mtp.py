"""Grade what an MTP case's answer says beyond its rows (``Response.mtp``): the acceptance, the drafts and the
output, against the oracle's rounds recorded in the case (``conformance.sets.case.MtpCase``).

The rows themselves (the prompt's last row, every draft step's logits, every verification row) are graded
by ``grading.grade_case`` like any rows. Here, in order, the first failure is the case's:

``mtp``           no ``Response.mtp``, or one whose rounds do not match the request
``mtp_output``    the assisted output is not plain greedy decoding (a verifier or rollback bug: drafts must
                  never change the output), at the first token whose greedy choice is decided
``mtp_accepted``  (mode "rounds") a round's acceptance differs from the oracle's, where every verification
                  row that decides it is decided (the target's top-1 minus top-2 logit above the profile's
                  tie margin)
``mtp_trace``     (mode "generate") a round's drafts or acceptance differ from the oracle's under the case's
                  convention, located by round and step; only up to the first undecided draft step

Every message names the round, the step or row, and what each side had.
"""

from __future__ import annotations

from ..sets.case import solo_cases
from .profiles import Profile
from .requests import sequence_response

__all__ = ["MTP_CHECKS", "grade_mtp"]

MTP_CHECKS = ("mtp", "mtp_output", "mtp_accepted", "mtp_trace")


def _first_difference(got, want) -> int | None:
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if g != w:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def grade_mtp(case, response, profile: Profile) -> tuple[str, str] | None:
    """(check, message) of the first failure of an MTP case's answer, or None when it passes; a batched case's
    first failing sequence, graded as its solo case, its message naming the sequence."""
    if case.mtp_batch:
        answers = response.mtp_batch
        if not isinstance(answers, (list, tuple)) or len(answers) != len(case.mtp_batch):
            return "mtp", (f"the response has {'no' if answers is None else len(answers)} MTP answers "
                           f"(Response.mtp_batch), the request {len(case.mtp_batch)} sequences")
        for s, solo in enumerate(solo_cases(case)):
            failure = grade_mtp(solo, sequence_response(response, s), profile)
            if failure is not None:
                return failure[0], f"sequence {s} ({solo.base}, {solo.length}-token prompt): {failure[1]}"
        return None
    spec, mtp = case.mtp, response.mtp
    tie = profile.tie_margin
    if mtp is None:
        return "mtp", "the response has no MTP answer (Response.mtp)"
    if spec.mode == "rounds" and len(mtp.accepted) != len(spec.rounds):
        return "mtp", f"{len(mtp.accepted)} rounds answered, the request has {len(spec.rounds)}"

    i = _first_difference(tuple(mtp.output), spec.output)
    if i is not None:
        what = (f"token {i}: got {mtp.output[i]}, plain greedy {spec.output[i]}" if i < min(len(mtp.output),
                                                                                           len(spec.output))
                else f"{len(mtp.output)} tokens, plain greedy decoding has {len(spec.output)}")
        return "mtp_output", (f"the assisted output is not plain greedy decoding at {what} (drafts must never change "
                              "the output: a verification or rollback bug)")

    if spec.mode == "rounds":
        P = case.length  # the pending token's position
        for r, (want, got) in enumerate(zip(spec.rounds, mtp.accepted, strict=False)):
            decided = min(want.verify_margins[:want.accepted + 1]) > tie
            if decided and got != want.accepted:
                return "mtp_accepted", (f"round {r} (pending token at position {P}): the engine accepted {got} of "
                                        f"{len(want.drafts)} drafts, the oracle {want.accepted} (drafts "
                                        f"{list(want.drafts)}; a verification bug, or verification rows that "
                                        "differ)")
            P += want.accepted + 1
        return None

    for r, want in enumerate(spec.rounds):
        if r >= len(mtp.drafts) or r >= len(mtp.accepted):
            return "mtp_trace", (f"round {r}: missing (the engine ran {len(mtp.drafts)} rounds, the oracle "
                                 f"{len(spec.rounds)})")
        got = tuple(mtp.drafts[r])
        for j, w in enumerate(want.drafts):
            if want.draft_margins[j] <= tie:
                return None  # an undecided draft: the rounds from here on may differ legitimately
            if j >= len(got) or got[j] != w:
                g = got[j] if j < len(got) else "nothing"
                return "mtp_trace", (f"round {r} step {j}: drafted {g}, the oracle drafts {w} under {spec.convention} "
                                     f"(drafter margin {want.draft_margins[j]:.3g}; the engine's round: {list(got)}, "
                                     f"the oracle's: {list(want.drafts)})")
        if len(got) != len(want.drafts):
            return "mtp_trace", f"round {r}: {len(got)} drafts, the oracle {len(want.drafts)}"
        if mtp.accepted[r] != want.accepted and min(want.verify_margins[:want.accepted + 1]) > tie:
            return "mtp_trace", f"round {r}: accepted {mtp.accepted[r]} of {len(got)}, the oracle {want.accepted}"
    return None
