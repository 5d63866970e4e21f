"""The mlx-lm backend's traces (capability ``traces``; ``conformance.backends.mlx_lm.backend``, ``_tapped``).

On two bundled sets (e2b-mini: per-layer inputs, KV sharing; 26b-a4b-mini: MoE), cases of every request kind
(full, last with input embeddings, prefill in micro-batches and in several pieces, multi, all with decode) are
answered with ``trace=True`` by the mlx-lm backend in float32 and by the oracle: every point the oracle returns
is served (``NOT_SERVED`` would list the exceptions, with the reason), every row of every point is within the
``fp32`` profile's ``nmse`` (``conformance.check.traces.point_errors``), the router's experts are the oracle's
as sets, and tracing changes nothing (same logits, the model's modules back in place). A weight perturbed in
one layer is located by ``compare_traces`` at that layer's point.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

import mlx.nn as nn
from helpers import same_run

from conformance.backends.mlx_lm.backend import MlxLmBackend
from conformance.backends.refimpl_backend import RefimplBackend
from conformance.check.profiles import PROFILES
from conformance.check.requests import build_request
from conformance.check.session import Checkpoints, Session
from conformance.check.traces import compare_traces, point_errors
from conformance.sets import bundled_set, load_set

FLOOR = PROFILES["fp32"].nmse  # 1e-6
# the oracle's points the mlx-lm backend does not serve, with the reason: every point maps exactly
NOT_SERVED: dict[str, str] = {}
CASES = {
    "e2b-mini": ("full/A/T9", "last/embeddings/C/T8/pos4", "prefill/B/T19/rows-middle+last/ub5",
                 "prefill/B/T20/chunks-3+12+5", "multi/A-T3+B-T8+C-T13"),
    "26b-a4b-mini": ("full/B/T19", "last/seq_id/B/T7/pos3", "prefill/A/T19/chunks-8+8+3", "multi/B-T7+C-T19"),
}


@pytest.fixture(scope="module")
def opened(tmp_path_factory):
    """Per set: (fixture set, {"oracle"|"mlx": (backend, its SetContext)}), both open on the set's checkpoint."""
    ck = Checkpoints(tmp_path_factory.mktemp("traces-mlx-lm"))
    out, sessions = {}, []
    for name in CASES:
        fs = load_set(bundled_set(name))
        pair = {}
        for who, backend in (("oracle", RefimplBackend()), ("mlx", MlxLmBackend())):
            session = Session(backend, ck)
            pair[who] = (backend, session.enter(fs))
            sessions.append(session)
        out[name] = (fs, pair)
    yield out
    for session in sessions:
        session.close()


def traced(backend, ctx, case):
    return backend.run(dataclasses.replace(build_request(case, ctx.bases, ctx.embed, ctx.media, ctx.drafter),
                                           trace=True))


def groups(resp) -> tuple[list[dict], list[np.ndarray]]:
    """The response's trace maps and logits, group by group: the prompt's rows, then each sequence's decode."""
    traces, logits = [resp.trace], [resp.logits]
    if resp.decode_logits is not None:
        multi = isinstance(resp.decode_trace, list)
        traces += resp.decode_trace if multi else [resp.decode_trace]
        logits += list(resp.decode_logits) if multi else [resp.decode_logits]
    return traces, logits


def case_of(fs, name: str, suffix: str):
    return next(c for c in fs.cases if c.id == f"{name}/{suffix}")


@pytest.mark.parametrize("name,suffix", [(n, s) for n, cases in CASES.items() for s in cases])
def test_every_oracle_point_served_within_fp32(opened, name, suffix):
    fs, pair = opened[name]
    (oracle, octx), (mlx, mctx) = pair["oracle"], pair["mlx"]
    case = case_of(fs, name, suffix)
    ref, got = traced(oracle, octx, case), traced(mlx, mctx, case)
    ref_groups, _ = groups(ref)
    got_groups, _ = groups(got)
    assert len(ref_groups) > 1 and len(got_groups) == len(ref_groups)  # every case here decodes
    worst = {}
    for r, g in zip(ref_groups, got_groups, strict=True):
        assert set(r) - set(g) <= set(NOT_SERVED), f"not served: {sorted(set(r) - set(g) - set(NOT_SERVED))}"
        assert set(g) <= set(r)
        for point in r:
            if point in g:
                worst[point] = max(worst.get(point, 0.0), float(point_errors(point, g[point], r[point]).max()))
    assert any(p.endswith("ple_add") for p in worst) == (name == "e2b-mini")
    assert any(p.endswith("router.experts") for p in worst) == (name == "26b-a4b-mini")
    over = {p: e for p, e in worst.items() if e > FLOOR}  # router: 1.0 where the experts differ as sets
    assert not over, f"over the fp32 nmse {FLOOR:g}: {over}"


def test_tracing_changes_nothing(opened):
    fs, pair = opened["e2b-mini"]
    mlx, ctx = pair["mlx"]
    case = case_of(fs, "e2b-mini", "prefill/B/T20/chunks-3+12+5")
    request = build_request(case, ctx.bases, ctx.embed, ctx.media, ctx.drafter)
    plain, with_trace = mlx.run(request), mlx.run(dataclasses.replace(request, trace=True))
    assert plain.trace is None and with_trace.trace
    same_run(with_trace.logits, plain.logits)
    same_run(with_trace.decode_logits, plain.decode_logits)
    layer = mlx._text_model().model.layers[3]
    assert isinstance(layer.post_feedforward_layernorm, nn.RMSNorm)
    assert isinstance(mlx._text_model().model.norm, nn.RMSNorm)


def test_perturbed_layer_is_located(opened):
    fs, pair = opened["e2b-mini"]
    (oracle, octx), (mlx, mctx) = pair["oracle"], pair["mlx"]
    case = case_of(fs, "e2b-mini", "full/A/T9")
    ref = traced(oracle, octx, case)
    # layer 2's feed-forward term grows by 1%: its post_feedforward_layernorm weight. (Scaling the MLP's down
    # projection as a whole would not show: that RMSNorm divides a uniform scale back out, to ~1e-13.)
    norm = mlx._text_model().model.layers[2].post_feedforward_layernorm
    weight = norm.weight
    norm.weight = weight * 1.01
    try:
        got = traced(mlx, mctx, case)
    finally:
        norm.weight = weight
    (ref_traces, ref_logits), (got_traces, got_logits) = groups(ref), groups(got)
    n = sum(len(x) for x in ref_logits)
    comparison = compare_traces(got_traces, ref_traces, got_logits, ref_logits, [f"row {i}" for i in range(n)],
                                ["interior"] * n, FLOOR)
    assert comparison.missing == []
    assert comparison.first_divergence["point"] == "layers.2.ffn_out"
