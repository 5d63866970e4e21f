"""The MTP cases of a fixture set (bundled ``e2b-assistant-mini``, ``12b-assistant-mini``, ``mtp-layout-mini`` and
``e2b-vision-assistant-mini``: MTP after an image and an audio prompt in the second and the last) and how the gate
grades them.

* The rows a set stores (the prompt's, every verification row, every draft step's: rebuilt through the
  target's and the drafter's heads) are the rows the oracle's round protocol computes when run on the request
  (``refimpl.mtp.run_rounds``), within float64 rounding; the recorded margins are those rows' top-2 margins.
* Requests: a rounds case needs ``mtp`` and its convention, a generate case ``mtp_generate``; a backend that
  declares only some conventions has the others reported as not claimed.
* Grading: a wrong acceptance (``mtp_accepted``), an output that is not plain greedy (``mtp_output``), a draft
  that differs from the oracle's in a generate case (``mtp_trace``, located by round and step), a drafter row
  off by a step (``identity``), a missing MTP answer (``mtp``); each with its message.
* Malformed MTP cases are refused with the field named.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conformance.backends.refimpl_backend import RefimplBackend
from conformance.check import materialise
from conformance.check.profiles import get_profile
from conformance.check.runner import run
from conformance.protocol.types import Capabilities, MtpRequest, Request, Response, required_capabilities
from conformance.sets.bundled import bundled_set
from conformance.sets.case import Case, mtp_rows, row_groups
from conformance.sets.integrity import load_set
from refimpl import Gemma4
from refimpl.assistant import Drafter
from refimpl.mtp import CONVENTIONS, run_rounds
from refimpl.multimodal import MultimodalInputs, load_multimodal_tokens, multimodal_inputs

MTP_SETS = ("e2b-assistant-mini", "12b-assistant-mini", "mtp-layout-mini", "e2b-vision-assistant-mini")
EXACT = get_profile("exact-f64")


def margins(rows: np.ndarray) -> np.ndarray:
    top = -np.sort(-rows, axis=-1)[:, :2]
    return top[:, 0] - top[:, 1]


def media_inputs(fs, target, model_dir, base: str, n: int) -> MultimodalInputs:
    """The oracle's inputs of the first ``n`` positions of media base ``base``, merged from its stored soft tokens."""
    images = [d["soft_tokens"] for d in fs.image_inputs(base)]
    clips = [d["soft_tokens"] for d in fs.audio_inputs(base)]
    tokens = load_multimodal_tokens(model_dir, ["image"] if images else ["audio"])
    full = multimodal_inputs(target, fs.bases()[base], images, tokens, audio_soft_tokens=clips)
    return MultimodalInputs(full.ids[:n], full.embeddings[:n],
                            None if full.vision_blocks is None else full.vision_blocks[:n], full.placeholders)


@pytest.mark.parametrize("name", MTP_SETS)
def test_stored_rows_are_the_round_protocol_run_again(name, tmp_path):
    fs = load_set(bundled_set(name))
    model_dir = materialise(fs, tmp_path)
    target, drafter = Gemma4(model_dir), Drafter(fs.drafter_dir(model_dir))
    logits, hidden = fs.mtp_rows(target, drafter)
    bases = fs.bases()
    seen = set()
    for case in (c for c in fs.cases if c.mtp is not None):  # (a batched case's rows are its solo cases')
        m = case.mtp
        prompt = bases[case.base][:case.length]
        assert list(bases[case.base][case.length:]) == list(m.output)  # the base: prompt, then plain greedy
        if m.mode != "rounds":
            continue
        inputs = None if m.media is None else media_inputs(fs, target, model_dir, m.media, case.length)
        if inputs is not None:  # the prompt is the media base's, placeholders in
            assert list(prompt) == list(bases[m.media][:case.length])
        got = run_rounds(target, drafter, prompt, [(r.token, r.drafts, r.accepted) for r in m.rounds], m.convention,
                         inputs=inputs)
        draft = logits[mtp_rows(case.base, "draft", m.convention)]
        verify = logits[mtp_rows(case.base, "verify")]
        d = np.concatenate([r.draft_logits for r in got.rounds])
        v = np.concatenate([r.verify_logits for r in got.rounds])
        assert draft.shape == d.shape and verify.shape == v.shape
        assert np.abs(draft - d).max() <= 1e-12 and np.abs(verify - v).max() <= 1e-12
        assert np.abs(hidden[mtp_rows(case.base, "verify")] - np.concatenate([r.verify_hidden for r in got.rounds])
                      ).max() <= 1e-12
        assert [r.accepted for r in got.rounds] == [r.accepted for r in m.rounds]
        assert got.output == m.output
        assert np.allclose(np.concatenate([r.draft_margins for r in m.rounds]), margins(d), atol=1e-12)
        seen.add(m.convention)
    assert seen == set(CONVENTIONS)


def test_requests_need_mtp_and_their_convention():
    fs = load_set(bundled_set("e2b-assistant-mini"))
    rounds = next(c for c in fs.cases if c.mtp.mode == "rounds" and c.mtp.convention == "rotating/P-1")
    gen = next(c for c in fs.cases if c.mtp.mode == "generate")
    def request(c):
        return Request(kind="mtp", tokens=(1, 2),
                       mtp=MtpRequest(c.mtp.mode, c.mtp.convention, c.mtp.num_drafts, c.mtp.max_new_tokens))

    assert required_capabilities(request(rounds)) == ["mtp", "mtp_conventions=rotating/P-1"]
    assert required_capabilities(request(gen))[0] == "mtp_generate"


class _OnlyDefault(RefimplBackend):
    def __init__(self):
        super().__init__()
        self.capabilities = Capabilities(**{**self.capabilities.to_dict(), "mtp_conventions": "target-cache/P"})


def test_undeclared_conventions_are_not_claimed():
    result = run(_OnlyDefault(), [bundled_set("e2b-assistant-mini")], EXACT)
    by = {}
    for c in result.cases:
        by.setdefault(c.status, set()).add(c.id.split("/")[-2] + "/" + c.id.split("/")[-1])
    assert by["pass"] == {"target-cache/P"} and "target-cache/P" not in by["not-claimed"]
    assert result.exit_code == 0


class _Tampered(RefimplBackend):
    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def run(self, request: Request) -> Response:
        r = super().run(request)
        if request.kind != "mtp":
            return r
        m = r.mtp
        if self.how == "accepted":
            m.accepted = [a + 1 for a in m.accepted]
        elif self.how == "output":
            m.output = m.output[:-1] + ((m.output[-1] + 1) % 512,)
        elif self.how == "draft":
            m.drafts = [tuple((t + 1) % 512 for t in d) for d in m.drafts]
        elif self.how == "shift" and m.draft_logits:
            m.draft_logits = [np.roll(d, 1, axis=0) for d in m.draft_logits]
        elif self.how == "none":
            r.mtp = None
        return r


@pytest.mark.parametrize("how, mode, check, says", [
    ("accepted", "rounds", "mtp_accepted", "round 0 (pending token at position"),
    ("output", "rounds", "mtp_output", "the assisted output is not plain greedy decoding at token"),
    ("draft", "generate", "mtp_trace", "round 0 step 0: drafted"),
    ("shift", "rounds", "identity", "round 0 draft 0: identity: the returned row is nearest to oracle row 2 "),
    ("none", "generate", "mtp", "the response has no MTP answer"),
])
def test_grading_names_what_differs(how, mode, check, says):
    result = run(_Tampered(how), [bundled_set("e2b-assistant-mini")], EXACT,
                 select=f"/mtp/{mode}/M0/target-cache/P$")
    (case,) = result.cases
    assert (case.status, case.check) == ("fail", check)
    assert says in case.message


def test_malformed_mtp_cases_are_refused():
    good = load_set(bundled_set("e2b-assistant-mini")).cases[0].to_json()
    with pytest.raises(ValueError, match="field 'mtp' has mode 'beam'"):
        Case.from_json({**good, "mtp": {**good["mtp"], "mode": "beam"}})
    with pytest.raises(ValueError, match="rounds must hold \\[token, drafts, accepted"):
        Case.from_json({**good, "mtp": {**good["mtp"], "rounds": [[1, 2]]}})
    case = Case.from_json(good)
    assert [g for g, _ in row_groups(case)][:3] == ["logits", "round 0 drafts", "round 0 verify"]


def test_the_subprocess_protocol_carries_mtp_requests():
    """The reference server (``python -m conformance.serve``) answers MTP requests through the protocol: every
    case of a bundled MTP set passes, its rows, hidden rows, acceptances and traces read back from files."""
    import sys

    from conformance.backends.subprocess.client import SubprocessBackend

    engine = SubprocessBackend(command=[sys.executable, "-m", "conformance.serve", "--backend", "refimpl"])
    result = run(engine, [bundled_set("12b-assistant-mini")], EXACT, select="/M[03]/")
    assert len(result.cases) == 24 and result.exit_code == 0, [c.message for c in result.cases if c.status != "pass"]
    rounds = next(c for c in result.cases if c.id.endswith("rounds/M0/transformers/P"))
    assert sum(r["label"].endswith(" hidden") for r in rounds.rows) == 1 + 4 * 4 + 1
    # MTP after media: the prompt's embeddings, blocks and media inputs travel too (the server's own towers)
    result = run(engine, [bundled_set("12b-assistant-mini")], EXACT, select="/mtp/.*/M[45]/target-cache/P$")
    assert len(result.cases) == 4 and result.exit_code == 0, [c.message for c in result.cases if c.status != "pass"]


# ----------------------------------------------------------------------------------------------
# batched MTP (spec M15): the text bases M0, M1, M3 drafting concurrently


def test_batched_cases_ask_every_sequence_at_once():
    """A batched case is one request: the three prompts (3, 2W - 1 and W + 3 tokens) with their seq ids and one
    MtpRequest each (their own rounds and budgets), needing mtp_batch besides the mode and convention."""
    from conformance.check.requests import build_request

    fs = load_set(bundled_set("e2b-assistant-mini"))
    case = next(c for c in fs.cases if c.id == "e2b-assistant-mini/mtp/rounds/batch-M0+M1+M3/rotating/P-1")
    solo = {c.base: c for c in fs.cases if c.mtp is not None and c.id.endswith("/rounds/" + c.base + "/rotating/P-1")}
    req = build_request(case, fs.bases(), None, None, Path("assistant"))
    assert [len(p) for p in req.sequences] == [3, 15, 11] and req.seq_ids == (0, 1, 2) and req.mtp is None
    assert [m.rounds for m in req.mtp_batch] == [build_request(solo[b], fs.bases(), None, None, None).mtp.rounds
                                                 for b in ("M0", "M1", "M3")]
    assert required_capabilities(req) == ["mtp", "mtp_conventions=rotating/P-1", "mtp_batch"]
    groups = row_groups(case)
    assert groups[0][0] == "seq 0 logits" and groups[-1][0] == "seq 2 round 0 verify"


class _TamperedBatch(RefimplBackend):
    def run(self, request: Request) -> Response:
        r = super().run(request)
        if request.mtp_batch:
            r.mtp_batch[1].accepted = [a + 1 for a in r.mtp_batch[1].accepted]
        return r


def test_batched_grading_names_the_sequence():
    result = run(_TamperedBatch(), [bundled_set("e2b-assistant-mini")], EXACT,
                 select=r"/mtp/rounds/batch-M0\+M1\+M3/target-cache/P$")
    (case,) = result.cases
    assert (case.status, case.check) == ("fail", "mtp_accepted")
    assert case.message.startswith("sequence 1 (M1, 15-token prompt): round 0 (pending token at position 15)")


def test_the_numpy_engine_verifies_the_sequences_in_one_batch_a_round():
    """The numpy engine's batched path: one multi-sequence prefill, then one verification call a round for every
    live sequence (5 rounds: M0's and M1's; M3 is done after one), each sequence's acceptance its solo run's; it
    passes the batched cases at exact-f64."""
    from conformance.selftest.backend import NumpyEngineBackend

    result = run(NumpyEngineBackend(), [bundled_set("12b-assistant-mini")], EXACT, select=r"/batch-M0\+M1\+M3/")
    assert len(result.cases) == 12 and result.exit_code == 0, [c.message for c in result.cases if c.status != "pass"]
    ex = next(c.executed for c in result.cases if c.id.endswith("/rounds/batch-M0+M1+M3/target-cache/P"))
    assert (ex["path"], ex["verify_calls"], ex["seq_ids"]) == ("mtp-batch", 5, [0, 1, 2])
    fs = load_set(bundled_set("12b-assistant-mini"))
    want = {c.base: [r.accepted for r in c.mtp.rounds] for c in fs.cases
            if c.mtp is not None and c.id.endswith(f"/rounds/{c.base}/target-cache/P")}
    assert ex["accepted"] == [want["M0"], want["M1"], want["M3"]]
