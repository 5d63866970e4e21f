"""The numpy engine (``conformance.backends.numpy_engine``) and its mutant zoo (``conformance.mutants``).

The engine batches tagged tokens through per-sequence KV caches and prunes to the output rows before
the first KV-shared layer; every request kind must still give the oracle's own full-forward rows on
every preset within 1e-12: full; last on the three entry points; output-row prefill with
micro-batches, some without an output row; chunked prefill with pieces longer than the sliding window;
three sequences in one batch; decode after each. The cache must keep W - 1 entries on sliding layers,
the layers >= K must really run on the output rows only, and the engine must pass the bundled sets
at exact-f64. Every mutant must differ from the engine on a few representative requests.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import max_abs, open_per_preset, tup

from conformance import cli, registry
from conformance.backend import Capabilities, Piece, Request
from conformance.backends.numpy_engine import NumpyEngineBackend
from conformance.mutants import BACKENDS, CLOSENESS, EQUIVALENT, MUTANTS, Mutant, mutant
from refimpl.synth import PRESETS

TOL = 1e-12
N = 40  # base length
W = 8  # sliding window of every preset
PRESET_NAMES = list(PRESETS)
GRADING_CHECKS = CLOSENESS | {"count", "shape", "nonfinite", "identity", "top1", "topk", "generation"}


@pytest.fixture(scope="module")
def engines(preset_dirs):
    yield from open_per_preset(NumpyEngineBackend, preset_dirs)


@pytest.fixture(scope="module")
def bases(oracle_bases):
    return oracle_bases


# ----------------------------------------------------------------------------------------------
# the protocol


def test_identity_capabilities_and_registry():
    b = NumpyEngineBackend()
    assert b.name == "numpy-engine"
    claimed = b.capabilities.to_dict()
    assert isinstance(b.capabilities, Capabilities)
    assert claimed.pop("embedding_convention") == "scaled"
    assert claimed.pop("default_profile") == "exact-f64"
    assert all(v is True for v in claimed.values()), claimed
    assert NumpyEngineBackend(dtype="float32").capabilities.default_profile == "fp32"
    assert "numpy-engine" in registry.available_backends()
    assert isinstance(registry.load_backend("numpy-engine"), NumpyEngineBackend)
    with pytest.raises(ValueError, match="dtype must be"):
        NumpyEngineBackend(dtype="float16")
    with pytest.raises(RuntimeError, match=r"run\(\) called before open\(\)"):
        b.run(Request("full", tokens=(2, 3)))


# ----------------------------------------------------------------------------------------------
# every request kind equals the oracle's rows


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_full_and_decode(engines, bases, preset):
    ids, ref = bases[preset][0]
    T, d = 21, 4
    r = engines[preset].run(Request("full", tokens=tup(ids[:T]), decode=tup(ids[T:T + d])))
    assert r.logits.dtype == np.float64 and r.logits.shape == (T, ref.shape[1])
    assert max_abs(r.logits, ref[:T]) < TOL
    assert max_abs(r.decode_logits, ref[T:T + d]) < TOL
    assert r.executed["state_len_after_prefill"] == T and r.executed["decode_ubatches"] == d


@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("entry", ["plain", "seq_id", "embeddings"])
def test_last_entries(engines, bases, preset_models, preset, entry):
    model = preset_models[preset]
    ids, ref = bases[preset][1]
    for T, last_pos in [(2 * W + 3, 2 * W + 2), (2 * W + 3, W + 1), (W + 1, 0), (1, 0)]:
        d = 3
        emb = model.embed(ids[:T]) if entry == "embeddings" else None
        req = Request("last", tokens=tup(ids[:T]), entry=entry, last_pos=last_pos,
                      seq_id=None if entry == "plain" else 7, embeddings=emb, decode=tup(ids[T:T + d]))
        r = engines[preset].run(req)
        assert max_abs(r.logits, ref[last_pos:last_pos + 1]) < TOL, (T, last_pos)
        assert max_abs(r.decode_logits, ref[T:T + d]) < TOL, (T, last_pos)
        assert r.executed["state_len_after_prefill"] == T


@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("ubatch", [None, 1, 4, 7, 64])
def test_prefill_output_rows_and_ubatches(engines, bases, preset, ubatch):
    ids, ref = bases[preset][0]
    T, d = 29, 2
    rows = (0, 5, 6, 17, 27, 28)  # with ubatch 4 and 7 some micro-batches have no output row
    r = engines[preset].run(Request("prefill", pieces=(Piece(tup(ids[:T]), rows),), ubatch=ubatch,
                                    decode=tup(ids[T:T + d])))
    assert max_abs(r.logits, ref[list(rows)]) < TOL
    assert max_abs(r.decode_logits, ref[T:T + d]) < TOL
    size = ubatch or T
    ubs = r.executed["ubatches"]
    assert [u["tokens"] for u in ubs] == [min(size, T - s) for s in range(0, T, size)]
    outputs = [u["outputs"] for u in ubs]
    assert outputs == [sum(s <= row < s + size for row in rows) for s in range(0, T, size)]
    if ubatch in (4, 7):
        assert 0 in outputs


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_prefill_without_any_row(engines, bases, preset):
    ids, ref = bases[preset][2]
    r = engines[preset].run(Request("prefill", pieces=(Piece(tup(ids[:12]), ()),), ubatch=5,
                                    decode=tup(ids[12:15])))
    assert r.logits.shape == (0, ref.shape[1])
    assert max_abs(r.decode_logits, ref[12:15]) < TOL


@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("ubatch", [None, 5])
def test_chunked_prefill(engines, bases, preset, ubatch):
    ids, ref = bases[preset][1]
    spec = [(10, (9,)), (2, ()), (W + 1, (0, 4, W)), (W + 5, (W + 4,)), (1, (0,))]  # pieces longer than W
    pieces, expect, start = [], [], 0
    for n, rows in spec:
        pieces.append(Piece(tup(ids[start:start + n]), rows))
        expect += [start + r for r in rows]
        start += n
    r = engines[preset].run(Request("prefill", pieces=tuple(pieces), ubatch=ubatch,
                                    decode=tup(ids[start:start + 2])))
    assert max_abs(r.logits, ref[expect]) < TOL
    assert max_abs(r.decode_logits, ref[start:start + 2]) < TOL
    assert r.executed["state_len_after_prefill"] == start


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_multi_three_sequences_in_one_batch(engines, bases, preset):
    (a, ra), (b, rb), (c, rc) = bases[preset]
    lengths, decode = (3, W + 1, 2 * W + 5), (3, 0, 2)
    seqs = [a[:lengths[0]], b[:lengths[1]], c[:lengths[2]]]
    req = Request("multi", sequences=tuple(tup(s) for s in seqs), seq_ids=(4, 0, 9),
                  decode=tuple(tup(base[n:n + d]) for base, n, d in zip((a, b, c), lengths, decode)))
    r = engines[preset].run(req)
    refs = (ra, rb, rc)
    assert max_abs(r.logits, np.stack([ref[n - 1] for ref, n in zip(refs, lengths)])) < TOL
    for got, ref, n, d in zip(r.decode_logits, refs, lengths, decode):
        assert max_abs(got, ref[n:n + d]) < TOL
    (ub,) = r.executed["ubatches"]  # ONE batch, one micro-batch, three sequences
    assert (ub["tokens"], ub["sequences"], ub["outputs"]) == (sum(lengths), 3, 3)
    assert r.executed["state_len_after_prefill"] == list(lengths)


def test_fresh_state_per_request(engines, bases):
    ids, ref = bases["e2b-mini"][0]
    req = Request("last", tokens=tup(ids[:10]), entry="seq_id", seq_id=3, last_pos=9)
    first, second = engines["e2b-mini"].run(req), engines["e2b-mini"].run(req)
    assert max_abs(first.logits, ref[9:10]) < TOL and max_abs(second.logits, first.logits) == 0.0


# ----------------------------------------------------------------------------------------------
# the engine's state and pruning


@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("ubatch", [None, 5])
def test_cache_keeps_w_minus_1_on_sliding_layers(engines, bases, preset, ubatch):
    engine = engines[preset].engine
    ids, _ = bases[preset][0]
    T = 2 * W + 3
    caches = engine.new_caches()
    batch = engine.batch(caches, ids[:T], [0] * T, [False] * (T - 1) + [True])
    engine.prefill(caches, batch, ubatch)
    cache = caches.get(0)
    assert cache.length == T
    for i, spec in enumerate(engine.cfg.layers):
        if not spec.owns_kv:
            assert i not in cache.layers  # KV-shared layers own nothing
        elif spec.is_sliding:
            assert cache.layers[i].pos.tolist() == list(range(T - (W - 1), T))
        else:
            assert cache.layers[i].pos.tolist() == list(range(T))
    # a decode step keeps it at W - 1
    engine.prefill(caches, engine.batch(caches, ids[T:T + 1], [0], [True]))
    sliding = [i for i, s in enumerate(engine.cfg.layers) if s.owns_kv and s.is_sliding]
    assert all(cache.entries(i) == W - 1 for i in sliding)


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_layers_from_k_run_on_output_rows_only(engines, bases, preset):
    engine = engines[preset].engine
    L, K = engine.cfg.num_hidden_layers, engine.cfg.first_shared_layer
    ids, ref = bases[preset][0]
    T, rows = 2 * W + 3, (9, 18)
    r = engines[preset].run(Request("prefill", pieces=(Piece(tup(ids[:T]), rows),), ubatch=5))
    assert max_abs(r.logits, ref[list(rows)]) < TOL
    assert r.executed["prune_layer"] == K
    ubs = r.executed["ubatches"]
    assert [u["outputs"] for u in ubs] == [0, 1, 0, 1]
    for u in ubs:
        if u["outputs"] == 0:
            assert u["layer_rows"] == [u["tokens"]] * K and u["head_rows"] == 0  # stops after layer K - 1
        else:
            assert u["layer_rows"] == [u["tokens"]] * K + [u["outputs"]] * (L - K)
            assert u["head_rows"] == u["outputs"]
    if engine.cfg.num_kv_shared_layers:
        assert K < L  # the KV-shared tail really ran on 1 row


def test_bundled_sets_pass_at_exact_f64(capsys):
    assert cli.main(["check", "--backend", "numpy-engine", "-q"]) == 0
    assert "260 pass" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# the mutant zoo


def test_mutant_catalogue():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names)) >= 24
    assert list(BACKENDS) == names
    for m in MUTANTS:
        assert isinstance(m, Mutant) and m.breaks and "\n" not in m.breaks
        assert m.bug_class in {f"B{i}" for i in range(1, 13)} | {f"trap {i}" for i in range(1, 18)}
        assert m.expected_checks is None or m.expected_checks <= GRADING_CHECKS
        b = m.backend()
        assert isinstance(b, NumpyEngineBackend) and b.dtype == "float64" and b.name.endswith(m.name)
        cls = BACKENDS[m.name]
        assert isinstance(registry.load_backend(f"conformance.mutants:{cls.__name__}"), cls)
    assert mutant("softcap-twice").expected_checks == CLOSENESS
    assert "moe-no-renormalise" in EQUIVALENT and "moe-no-renormalise" not in BACKENDS


def _representative_requests(model, bases) -> list[Request]:
    (a, _), (b, _), (c, _) = bases
    return [
        Request("last", tokens=tup(a[:17]), last_pos=8, decode=tup(a[17:19])),
        Request("last", tokens=tup(b[:17]), entry="seq_id", seq_id=2, last_pos=16),
        Request("last", tokens=tup(c[:9]), entry="embeddings", seq_id=1, last_pos=8, embeddings=model.embed(c[:9])),
        Request("prefill", pieces=(Piece(tup(a[:19]), (9, 18)),), ubatch=5, decode=tup(a[19:21])),
        Request("prefill", pieces=(Piece(tup(b[:11]), (10,)), Piece(tup(b[11:21]), (9,))), decode=tup(b[21:23])),
        Request("multi", sequences=(tup(a[:3]), tup(b[:W]), tup(c[:13])), seq_ids=(0, 1, 2),
                decode=(tup(a[3:5]), tup(b[W:W + 2]), tup(c[13:15]))),
    ]


def _answers(backend, requests) -> list[np.ndarray]:
    out = []
    for req in requests:
        r = backend.run(req)
        out.append(np.asarray(r.logits, dtype=np.float64))
        if r.decode_logits is not None:
            out += [np.asarray(d, dtype=np.float64) for d in
                    (r.decode_logits if isinstance(r.decode_logits, list) else [r.decode_logits])]
    return out


def _largest_difference(mutated, reference) -> float:
    return max(max_abs(g, e) if g.shape == e.shape else np.inf for g, e in zip(mutated, reference))


@pytest.fixture(scope="module")
def zoo_reference(engines, preset_models, bases):
    requests = _representative_requests(preset_models["all-features"], bases["all-features"])
    return requests, _answers(engines["all-features"], requests)


@pytest.mark.parametrize("m", MUTANTS, ids=lambda m: m.name)
def test_mutant_differs_from_engine(m, zoo_reference, preset_dirs):
    requests, expected = zoo_reference
    b = m.backend()
    b.open(preset_dirs["all-features"])
    try:
        assert _largest_difference(_answers(b, requests), expected) > 1e-3, m.name
    finally:
        b.close()


def test_equivalent_mutant_is_below_float_tolerance(zoo_reference, preset_dirs):
    """Skipping the MoE top-k renormalisation only leaks through the eps of the expert post-norm."""
    requests, expected = zoo_reference
    m, reason = EQUIVALENT["moe-no-renormalise"]
    assert "post_feedforward_layernorm_2" in reason
    b = m.backend()
    b.open(preset_dirs["all-features"])
    diff = _largest_difference(_answers(b, requests), expected)
    assert 0 < diff < 1e-3
