"""The numpy engine (``conformance.selftest.engine``) and its mutant zoo (``conformance.mutants``).

The engine batches tagged tokens through per-sequence KV caches and prunes to the output rows before
the first KV-shared layer; every request kind must still give the oracle's own full-forward rows on
every preset within 1e-12: full; last on the three entry points; output-row prefill with
micro-batches, some without an output row; chunked prefill with pieces longer than the sliding window;
three sequences in one batch; decode after each. The cache must keep W - 1 entries on sliding layers,
the layers >= K must really run on the output rows only, and the engine must pass the bundled sets
at exact-f64. Every mutant must differ from the engine on a few representative requests.

Image prompts (the two vision presets, two images, one block longer than W): last rows before, at,
inside and right after each block, output-row and chunked prefill split at block boundaries, decode
after, the vision block ids in the cache (and through pruning on a KV-shared micro model), and the
image mutants, each on the preset that exposes it (and a no-op on the other).

Audio prompts (preset e2b-audio-mini, two clips of synthetic audio through the feature extractor): the
engine's own soft tokens equal the oracle's audio tower, last rows inside and right after each block,
output-row and chunked prefill split at block boundaries, decode after, all equal to the oracle's
``multimodal_logits``; wrong audio rows in the given embeddings change nothing (the engine runs its own
tower); refusals; each audio mutant far from the engine, and a no-op on an image prompt.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from helpers import image_prompt, max_abs, micro_config, open_per_preset, tup

from conformance import cli, registry
from conformance.backends.refimpl_backend import RefimplBackend
from conformance.protocol import AudioInput, Capabilities, Piece, Request
from conformance.selftest.backend import NumpyEngineBackend
from conformance.selftest.engine import Engine
from conformance.selftest.mutants import (
    AUDIO_SET,
    BACKENDS,
    CLOSENESS,
    EQUIVALENT,
    IMAGE_SET_BIDIRECTIONAL,
    IMAGE_SET_PLE,
    IMAGE_SETS,
    MTP_MEDIA_SETS,
    MTP_SET_CENTROID,
    MTP_SET_LAYOUT,
    MTP_SETS,
    MUTANTS,
    PLE_EPS_SET,
    UNIFIED_SET,
    Mutant,
    mutant,
)
from conformance.selftest.state import NO_BLOCK
from conformance.selftest.video_mutants import VIDEO_SETS
from refimpl.model import Gemma4
from refimpl.mtp import CONVENTIONS
from refimpl.synth import PRESETS

TOL = 1e-12
N = 40  # base length
W = 8  # sliding window of every preset
PRESET_NAMES = list(PRESETS)
VISION_PRESETS = [p for p in PRESETS if "vision" in PRESETS[p] and not PRESETS[p].get("assistant")]  # (MTP pairs aside)
TEXT_MUTANTS = [m for m in MUTANTS if not m.kill_sets]  # killed on all-features
IMAGE_MUTANTS = [m for m in MUTANTS if set(m.kill_sets) & set(IMAGE_SETS)]  # need image prompts
AUDIO_MUTANTS = [m for m in MUTANTS if AUDIO_SET in m.kill_sets]  # need audio prompts
MTP_MUTANTS = [m for m in MUTANTS if set(m.kill_sets) & set(MTP_SETS)]  # need MTP requests
UNIFIED_MUTANTS = [m for m in MUTANTS if m.kill_sets == (UNIFIED_SET,)]  # need Gemma 4 Unified's embedders
PLE_FOLD_MUTANTS = [m for m in MUTANTS if m.kill_sets == (PLE_EPS_SET,)]  # need per-layer contexts near eps
VIDEO_MUTANTS = [m for m in MUTANTS if set(m.kill_sets) & set(VIDEO_SETS)]  # need video prompts
AUDIO_PRESET = "e2b-audio-mini"
GRADING_CHECKS = CLOSENESS | {"count", "shape", "nonfinite", "identity", "top1", "topk", "generation", "hidden",
                               "hidden_identity", "mtp", "mtp_output", "mtp_accepted", "mtp_trace"}


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
    assert claimed.pop("mtp_conventions") == ",".join(CONVENTIONS)  # it serves every MTP convention
    assert claimed.pop("weight_formats") == "safetensors,mlx-affine,gguf"  # through the oracle's loader
    assert claimed.pop("activation_conventions") == "none"
    assert claimed.pop("top_logprobs") is False  # whole logits rows
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
                  decode=tuple(tup(base[n:n + d]) for base, n, d in zip((a, b, c), lengths, decode, strict=True)))
    r = engines[preset].run(req)
    refs = (ra, rb, rc)
    assert max_abs(r.logits, np.stack([ref[n - 1] for ref, n in zip(refs, lengths, strict=True)])) < TOL
    for got, ref, n, d in zip(r.decode_logits, refs, lengths, decode, strict=True):
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
    from conformance.sets import bundled_sets, load_set

    sets = [load_set(p) for p in bundled_sets()]
    # 260 text cases, and the image sets' cases; not those of the GGUF sets made under ggml's activation
    # convention, which this engine does not follow (not claimed)
    n = sum(len(fs.cases) for fs in sets if fs.activations == "none")
    other = sum(len(fs.cases) for fs in sets) - n
    assert n >= 260 and other == 104
    assert cli.main(["check", "--backend", "numpy-engine", "-q"]) == 0
    assert f"{n} pass, {other} not-claimed" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# the mutant zoo


def test_mutant_catalogue():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names)) >= 24
    assert list(BACKENDS) == names
    for m in MUTANTS:
        assert isinstance(m, Mutant) and m.breaks and "\n" not in m.breaks
        assert m.bug_class in {f"B{i}" for i in range(1, 13)} | {f"trap {i}" for i in range(1, 18)} | {
            "mm trap 24", "mm §9"} | {f"unified U{i}" for i in range(1, 15)} | {f"mtp M{i}" for i in range(1, 16)}
        assert m.expected_checks is None or m.expected_checks <= GRADING_CHECKS
        b = m.backend()
        assert isinstance(b, NumpyEngineBackend) and b.dtype == "float64" and b.name.endswith(m.name)
        cls = BACKENDS[m.name]
        assert isinstance(registry.load_backend(f"conformance.selftest.mutants:{cls.__name__}"), cls)
    assert mutant("softcap-twice").expected_checks == CLOSENESS
    assert {m.name: m.kill_sets for m in IMAGE_MUTANTS} == {
        "soft-tokens-scaled": (IMAGE_SET_PLE, IMAGE_SET_BIDIRECTIONAL, UNIFIED_SET),
        "ple-placeholder-row": (IMAGE_SET_PLE,),
        "vision-blocks-on-full-layers": (IMAGE_SET_BIDIRECTIONAL, UNIFIED_SET),
        "vision-blocks-missing": (IMAGE_SET_BIDIRECTIONAL, UNIFIED_SET),
        "vision-window-unclamped": (IMAGE_SET_BIDIRECTIONAL, UNIFIED_SET),
        "image-split-across-ubatches": (IMAGE_SET_BIDIRECTIONAL, UNIFIED_SET),
    }
    assert {m.name for m in UNIFIED_MUTANTS} == {"patch-layernorm-eps-1e-6", "patch-rmsnorm", "patch-order-chw",
                                                 "position-axes-swapped", "padding-rows-kept",
                                                 "audio-frames-not-normed"}
    assert all(m.kill_sets == (UNIFIED_SET,) for m in UNIFIED_MUTANTS)
    assert set(VISION_PRESETS) == {IMAGE_SET_PLE, IMAGE_SET_BIDIRECTIONAL}
    assert {m.name: m.kill_sets for m in AUDIO_MUTANTS} == {
        name: (AUDIO_SET,) for name in ("audio-chunking-wrong", "audio-logit-cap-missing", "audio-soft-tokens-scaled",
                                        "audio-ple-placeholder-row")}
    assert AUDIO_SET == AUDIO_PRESET and "audio" in PRESETS[AUDIO_PRESET]
    assert {m.name for m in MTP_MUTANTS} == {n for n in BACKENDS if n.startswith("mtp-")}
    special = {"mtp-centroid-top-k-minus-1": (MTP_SET_CENTROID,), "mtp-positional-store-layers": (MTP_SET_LAYOUT,),
               "mtp-media-state-not-advanced": MTP_MEDIA_SETS,
               "mtp-media-positions-without-soft-tokens": MTP_MEDIA_SETS}
    assert all(m.kill_sets == special.get(m.name, MTP_SETS) for m in MTP_MUTANTS)
    assert {m.name for m in PLE_FOLD_MUTANTS} == {"ple-fold-eps-kept", "ple-fold-eps-over-s"}
    assert {m.name for m in VIDEO_MUTANTS} == {"video-frames-not-vision", "video-frames-one-block",
                                               "video-timestamps-dropped"}
    assert len(MUTANTS) == len(TEXT_MUTANTS) + len(IMAGE_MUTANTS) + len(AUDIO_MUTANTS) + len(UNIFIED_MUTANTS) + \
        len(MTP_MUTANTS) + len(PLE_FOLD_MUTANTS) + len(VIDEO_MUTANTS)
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
        r = backend.run(dataclasses.replace(req, hidden=True))  # the hidden-state rows are answers too
        for rows, decode in ((r.logits, r.decode_logits), (r.hidden, r.decode_hidden)):
            out.append(np.asarray(rows, dtype=np.float64))
            if decode is not None:
                out += [np.asarray(d, dtype=np.float64) for d in (decode if isinstance(decode, list) else [decode])]
    return out


def _largest_difference(mutated, reference) -> float:
    return max(max_abs(g, e) if g.shape == e.shape else np.inf for g, e in zip(mutated, reference, strict=True))


@pytest.fixture(scope="module")
def zoo_reference(engines, preset_models, bases):
    requests = _representative_requests(preset_models["all-features"], bases["all-features"])
    return requests, _answers(engines["all-features"], requests)


@pytest.mark.parametrize("m", TEXT_MUTANTS, ids=lambda m: m.name)
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


# ----------------------------------------------------------------------------------------------
# image prompts
#
# Measured worst case over every exactness test below (numpy-engine vs the oracle, float64, logits up to
# ~30 under the softcap): 3.4e-13 (chunked prefill), 1.1e-13 (last rows), 2e-14 against the refimpl
# backend, 0 on the pruned micro model; bound TOL = 1e-12.


@pytest.fixture(scope="module")
def prompts(preset_dirs):
    """{vision preset: image_prompt}: bos + 4 text + [boi, 12 image, eoi] + 6 text + [boi, 4 image, eoi] + 6
    text (T = 37): blocks (6, 12) and (26, 4); the first is longer than the window W = 8."""
    return {p: image_prompt(preset_dirs[p], grids=((9, 12), (6, 6))) for p in VISION_PRESETS}


def _image_last(pr, T: int, last_pos: int, decode: int = 0) -> Request:
    ids, emb = pr["ids"], pr["embeddings"]
    return Request("last", tokens=tup(ids[:T]), entry="embeddings", seq_id=3, last_pos=last_pos,
                   embeddings=emb[:T], images=tuple(pr["images"]), decode=tup(ids[T:T + decode]),
                   image_inputs=tuple(pr["inputs"][:len(pr["images"])]))


def _image_prefill(pr, cuts, rows, decode: int = 0, images=None) -> tuple[Request, list[int]]:
    """Pieces [cuts[j], cuts[j+1]) with their rows (within the piece); returns the request and the rows
    of the prompt it answers."""
    ids, emb = pr["ids"], pr["embeddings"]
    pieces, expect = [], []
    for (a, b), r in zip(itertools.pairwise(cuts), rows, strict=True):
        pieces.append(Piece(tup(ids[a:b]), tuple(r), emb[a:b]))
        expect += [a + x for x in r]
    end = cuts[-1]
    images = tuple(pr["images"] if images is None else images)
    req = Request("prefill", pieces=tuple(pieces), images=images, decode=tup(ids[end:end + decode]),
                  image_inputs=tuple(pr["inputs"][:len(images)]))
    return req, expect


def test_image_prompt_layout(prompts):
    for pr in prompts.values():
        assert pr["images"] == [(6, 12), (26, 4)] and len(pr["ids"]) == 37


@pytest.mark.parametrize("preset", VISION_PRESETS)
def test_image_last_rows(engines, prompts, preset):
    pr = prompts[preset]
    ref, T = pr["logits"], len(pr["ids"])
    (s0, n0), (s1, n1) = pr["images"]
    rows = [s0 - 1, s0, s0 + 3, s0 + n0 - 2, s0 + n0 - 1, s0 + n0, s0 + n0 + 1, s1 + 1, s1 + n1, T - 1]
    for last_pos in rows:  # boi, first / inside / last image token, eoi, text after, the last row
        r = engines[preset].run(_image_last(pr, T, last_pos))
        assert max_abs(r.logits, ref[last_pos:last_pos + 1]) < TOL, last_pos
        assert r.executed["images"] == pr["images"]
    # decode (text) after a prompt that ends after the second image
    T2 = s1 + n1 + 2
    r = engines[preset].run(_image_last(pr, T2, T2 - 1, decode=3))
    assert max_abs(r.logits, ref[T2 - 1:T2]) < TOL and max_abs(r.decode_logits, ref[T2:T2 + 3]) < TOL


@pytest.mark.parametrize("preset", VISION_PRESETS)
def test_image_prefill_rows_and_chunks(engines, prompts, preset):
    pr = prompts[preset]
    ref, T = pr["logits"], len(pr["ids"])
    (s0, n0), (s1, n1) = pr["images"]
    plans = [
        # one piece: rows inside, at the end of and right after the blocks, and the last; decode after
        ([0, T - 3], [(s0 + 1, s0 + 7, s0 + n0 - 1, s0 + n0 + 1, s1, s1 + n1, T - 4)]),
        # the first piece ends right after eoi; the second holds the other image
        ([0, s0 + n0 + 1, T - 3], [(s0 + 2, s0 + n0), (0, s1 + 1 - (s0 + n0 + 1), T - 4 - (s0 + n0 + 1))]),
        # split at every block boundary: ... boi | image | eoi ... boi | image + eoi + text
        ([0, s0, s0 + n0, s1, T - 3], [(s0 - 1,), (0, 5, n0 - 1), (), (1, n1, T - 4 - s1)]),
    ]
    for cuts, rows in plans:
        req, expect = _image_prefill(pr, cuts, rows, decode=3)
        r = engines[preset].run(req)
        assert max_abs(r.logits, ref[expect]) < TOL, cuts
        assert max_abs(r.decode_logits, ref[T - 3:T]) < TOL, cuts
        assert r.executed["state_len_after_prefill"] == T - 3


@pytest.mark.parametrize("preset", VISION_PRESETS)
def test_image_engine_agrees_with_refimpl_backend(engines, prompts, preset_dirs, preset):
    """The same chunked request through the refimpl backend (the oracle's own cached forward)."""
    pr = prompts[preset]
    (s0, n0), _ = pr["images"]
    req, _ = _image_prefill(pr, [0, s0 + n0 + 1, 34], [(s0 + 4, s0 + n0), (0, 5, 32 - (s0 + n0))], decode=3)
    oracle = RefimplBackend()
    oracle.open(preset_dirs[preset])
    want = oracle.run(req)
    got = engines[preset].run(req)
    assert max_abs(got.logits, want.logits) < TOL and max_abs(got.decode_logits, want.decode_logits) < TOL


@pytest.mark.parametrize("preset", VISION_PRESETS)
def test_cache_stores_vision_block_ids(engines, prompts, preset):
    """Each key's block id (the position of its block's first token) sits next to its position, for
    every layer; a text piece after the image piece then equals the full forward."""
    engine, pr = engines[preset].engine, prompts[preset]
    ids, emb, ref = pr["ids"], pr["embeddings"], pr["logits"]
    (s0, n0), _ = pr["images"]
    cut = s0 + n0 + 1  # right after eoi
    caches = engine.new_caches()
    engine.prefill(caches, engine.batch(caches, ids[:cut], [0] * cut, [False] * cut, emb[:cut], [(s0, n0)]))
    cache = caches.get(0)
    expect = np.where((np.arange(cut) >= s0) & (np.arange(cut) < s0 + n0), s0, NO_BLOCK)
    for i, spec in enumerate(engine.cfg.layers):
        if spec.owns_kv:
            kv = cache.layers[i]
            assert kv.blocks.tolist() == expect[kv.pos].tolist(), i
    text = ids[cut:cut + 5]
    out = engine.prefill(caches, engine.batch(caches, text, [0] * 5, [True] * 5))  # no embeddings: text
    assert max_abs(out, ref[cut:cut + 5]) < TOL


def test_pruned_rows_keep_their_block_ids(micro_factory):
    """A KV-shared, vision-bidirectional micro model with PLE: output rows inside a block are pruned
    before the KV-shared layers, whose mask must see the rest of the block through the source layer's
    cache; equal to the oracle's forward."""
    S, F = "sliding_attention", "full_attention"
    cfg = micro_config(num_hidden_layers=6, layer_types=[S, S, F, S, S, F], num_kv_shared_layers=3,
                       hidden_size_per_layer_input=4, use_bidirectional_attention="vision")
    model = Gemma4(micro_factory(cfg, 5))
    engine = Engine(model)
    rng = np.random.default_rng(0)
    T, (s, n), image_id = 16, (4, 7), 5  # block of 7 > W = 3
    ids = rng.integers(6, 64, T)
    ids[s:s + n] = image_id
    x = model.embed(ids)
    x[s:s + n] = rng.normal(0.0, 1.0, (n, cfg["hidden_size"]))  # soft tokens
    llm_ids = np.where(ids == image_id, 0, ids)
    blocks = np.where(ids == image_id, 0, -1)
    rows = [s + 1, s + 3, T - 1]
    want = model.forward(llm_ids, rows=rows, embeddings=x, vision_blocks=blocks)
    caches = engine.new_caches()
    output = np.isin(np.arange(T), rows)
    got = engine.prefill(caches, engine.batch(caches, ids, [0] * T, output, x, [(s, n)]))
    assert engine.log[0]["layer_rows"] == [T] * 3 + [len(rows)] * 3  # really pruned before layer 3
    assert max_abs(got, want) < TOL


@pytest.mark.parametrize("preset", VISION_PRESETS)
def test_image_requests_refused(engines, prompts, preset):
    pr = prompts[preset]
    b = engines[preset]
    (s0, n0), _ = pr["images"]
    req, _ = _image_prefill(pr, [0, s0 + 5, 30], [(), (3,)])
    with pytest.raises(ValueError, match="straddles pieces 0 and 1"):
        b.run(req)
    req, _ = _image_prefill(pr, [0, 30], [(29,)])
    with pytest.raises(ValueError, match="ubatch"):
        b.run(Request("prefill", pieces=req.pieces, images=req.images, ubatch=8))
    with pytest.raises(ValueError, match="holds tokens other than the image token"):
        b.run(_image_prefill(pr, [0, 30], [(29,)], images=[(s0 - 1, n0)])[0])
    with pytest.raises(ValueError, match="needs entry 'embeddings'"):
        b.run(Request("last", tokens=tup(pr["ids"]), entry="seq_id", seq_id=1, last_pos=3, images=tuple(pr["images"])))
    with pytest.raises(ValueError, match="not on 'full'"):
        b.run(Request("full", tokens=tup(pr["ids"]), images=tuple(pr["images"])))
    with pytest.raises(ValueError, match="piece 1 of an image prompt has no embeddings"):
        b.run(Request("prefill", pieces=(req.pieces[0], Piece((2,), (0,))), images=req.images))


def _image_mutant_difference(m: Mutant, preset_dirs, prompts, preset: str) -> float:
    """The largest |logit| difference from the oracle over every row of the image prompt (one prefill)."""
    pr = prompts[preset]
    T = len(pr["ids"])
    req, expect = _image_prefill(pr, [0, T], [range(T)])
    b = m.backend()
    b.open(preset_dirs[preset])
    try:
        return max_abs(b.run(req).logits, pr["logits"][expect])
    finally:
        b.close()


@pytest.mark.parametrize("m", IMAGE_MUTANTS, ids=lambda m: m.name)
@pytest.mark.parametrize("preset", VISION_PRESETS)
def test_image_mutants_differ_where_their_set_applies(m, preset, preset_dirs, prompts):
    diff = _image_mutant_difference(m, preset_dirs, prompts, preset)
    if preset in m.kill_sets:
        assert diff > 1.0, (m.name, preset, diff)  # measured: 4.7 (blocks on full layers) to 43
    else:
        # e2b-vision-mini is causal over images, so the block-mask mutants change nothing there; 31b has
        # no PLE, so the placeholder row is never read: each needs its own set
        assert diff == 0.0, (m.name, preset, diff)


# ----------------------------------------------------------------------------------------------
# audio prompts
#
# Measured (numpy-engine vs the oracle's full multimodal_logits, float64, logits up to ~27 under the
# softcap): 7.2e-14 over every last row of the prompt, 0 for a one-piece prefill, 3.9e-13 for two pieces;
# bound TOL = 1e-12. Splitting at all six block boundaries with every row reaches 1.09e-12, exactly the
# oracle's own chunked (KVCache) forward against its full forward: the engine equals the oracle's chunked
# forward bit for bit there, the rest is float64 rounding of the chunking. The engine's soft tokens equal
# the oracle's audio tower bit for bit (the same code).


def _audio_prompt(model_dir, durations=(0.7, 0.5), seed: int = 0, text=(4, 6)) -> dict:
    """bos + text + (boa + audio x M + eoa + text) per clip; each clip a chirp plus noise at 16 kHz through
    refimpl's feature extractor and audio tower. Returns ids, embeddings (scaled convention, the oracle's
    soft tokens at audio rows), audio [(start, M)], inputs (AudioInput per clip), soft, logits [T, V]."""
    from refimpl.audio import audio_tower, load_audio_tower
    from refimpl.audio_features import audio_features, load_audio_feature_settings
    from refimpl.multimodal import audio_spans, load_multimodal_tokens, multimodal_inputs, multimodal_logits

    model = Gemma4(model_dir)
    weights, acfg = load_audio_tower(model_dir)
    tokens = load_multimodal_tokens(model_dir)
    settings = load_audio_feature_settings(model_dir)
    rng = np.random.default_rng(seed)
    inputs = []
    for k, dur in enumerate(durations):
        t = np.arange(int(dur * 16000)) / 16000
        wave = 0.5 * np.sin(2 * np.pi * ((200 + 400 * k) * t + 1500 * t * t)) + 0.05 * rng.normal(size=t.size)
        f = audio_features(wave, 16000, settings)
        inputs.append(AudioInput(f.features, f.mask))
    soft = [audio_tower(a.features, a.mask, weights, acfg) for a in inputs]

    def words(n: int) -> list[int]:
        return [int(x) for x in rng.integers(20, 400, n)]

    ids = [2] + words(text[0])
    for e in soft:
        ids += [tokens.boa_token_id] + [tokens.audio_token_id] * e.shape[0] + [tokens.eoa_token_id] + words(text[1])
    m = multimodal_inputs(model, ids, [], tokens, audio_soft_tokens=soft)
    logits = multimodal_logits(model, ids, [], tokens, audio_soft_tokens=soft)
    return {"ids": np.asarray(ids, dtype=np.int64), "embeddings": m.embeddings, "audio": audio_spans(ids, tokens),
            "inputs": tuple(inputs), "soft": soft, "logits": logits, "tokens": tokens, "weights": (weights, acfg)}


@pytest.fixture(scope="module")
def audio(preset_dirs):
    """Blocks (6, 18) and (32, 13), T = 52: both longer than the window W = 8."""
    return _audio_prompt(preset_dirs[AUDIO_PRESET])


def _audio_last(pr, T: int, last_pos: int, decode: int = 0, embeddings=None) -> Request:
    ids = pr["ids"]
    emb = pr["embeddings"] if embeddings is None else embeddings
    blocks = tuple((s, n) for s, n in pr["audio"] if s + n <= T)
    return Request("last", tokens=tup(ids[:T]), entry="embeddings", seq_id=5, last_pos=last_pos,
                   embeddings=emb[:T], audio=blocks, audio_inputs=pr["inputs"][:len(blocks)],
                   decode=tup(ids[T:T + decode]))


def _audio_prefill(pr, cuts, rows, decode: int = 0, embeddings=None, **change) -> tuple[Request, list[int]]:
    ids = pr["ids"]
    emb = pr["embeddings"] if embeddings is None else embeddings
    pieces, expect = [], []
    for (a, b), r in zip(itertools.pairwise(cuts), rows, strict=True):
        pieces.append(Piece(tup(ids[a:b]), tuple(r), emb[a:b]))
        expect += [a + x for x in r]
    end = cuts[-1]
    req = Request("prefill", pieces=tuple(pieces), audio=tuple(change.pop("audio", pr["audio"])),
                  audio_inputs=tuple(change.pop("audio_inputs", pr["inputs"])), decode=tup(ids[end:end + decode]),
                  **change)
    return req, expect


def test_audio_prompt_layout_and_tower(engines, audio, preset_dirs):
    assert audio["audio"] == [(6, 18), (32, 13)] and len(audio["ids"]) == 52
    engine = engines[AUDIO_PRESET].engine
    # loaded only with audio_config
    assert engine.audio_cfg is not None and engines["e2b-mini"].engine.audio_weights is None
    for a, want in zip(audio["inputs"], audio["soft"], strict=True):
        got = engine.audio_soft_tokens(a.features, a.mask)
        assert got.shape == want.shape and np.array_equal(got, want)
    assert engine.audio_config() == audio["weights"][1]  # the hooks give the checkpoint's own geometry and cap


def test_audio_last_rows(engines, audio):
    ref, T = audio["logits"], len(audio["ids"])
    (s0, n0), (s1, n1) = audio["audio"]
    rows = [s0 - 1, s0, s0 + 5, s0 + n0 - 1, s0 + n0, s0 + n0 + 1, s1 + 2, s1 + n1, T - 1]
    for last_pos in rows:  # boa, first / inside / last audio token, eoa, text after, the last row
        r = engines[AUDIO_PRESET].run(_audio_last(audio, T, last_pos))
        assert max_abs(r.logits, ref[last_pos:last_pos + 1]) < TOL, last_pos
        assert r.executed["audio"] == audio["audio"]
    T2 = s0 + n0 + 3  # only the first clip, then text decode
    r = engines[AUDIO_PRESET].run(_audio_last(audio, T2, T2 - 1, decode=3))
    assert r.executed["audio"] == [(s0, n0)]
    assert max_abs(r.logits, ref[T2 - 1:T2]) < TOL and max_abs(r.decode_logits, ref[T2:T2 + 3]) < TOL


def test_audio_prefill_rows_and_chunks(engines, audio):
    ref, T = audio["logits"], len(audio["ids"])
    (s0, n0), (s1, n1) = audio["audio"]
    plans = [
        ([0, T - 3], [(s0 + 1, s0 + 9, s0 + n0 - 1, s0 + n0 + 1, s1, s1 + n1, T - 4)]),
        ([0, s0 + n0 + 1, T - 3], [(s0 + 2, s0 + n0), (0, s1 + 1 - (s0 + n0 + 1), T - 4 - (s0 + n0 + 1))]),
        ([0, s0, s0 + n0, s1, T - 3], [(s0 - 1,), (0, 7, n0 - 1), (), (1, n1, T - 4 - s1)]),  # at every boundary
    ]
    for cuts, rows in plans:
        req, expect = _audio_prefill(audio, cuts, rows, decode=3)
        r = engines[AUDIO_PRESET].run(req)
        assert max_abs(r.logits, ref[expect]) < TOL, cuts
        assert max_abs(r.decode_logits, ref[T - 3:T]) < TOL, cuts
        assert r.executed["state_len_after_prefill"] == T - 3


def test_audio_given_rows_are_ignored(engines, audio):
    """The engine runs its own audio tower: garbage at the audio rows of the given embeddings changes nothing,
    and the request's arrays are not written to."""
    T = len(audio["ids"])
    wrong = audio["embeddings"].copy()
    wrong[audio["ids"] == audio["tokens"].audio_token_id] = 7.0
    kept = wrong.copy()
    b = engines[AUDIO_PRESET]
    right = b.run(_audio_prefill(audio, [0, 25, T], [(5, 19), (3, T - 26)])[0])
    got = b.run(_audio_prefill(audio, [0, 25, T], [(5, 19), (3, T - 26)], embeddings=wrong)[0])
    assert np.array_equal(got.logits, right.logits) and np.array_equal(wrong, kept)
    last = b.run(_audio_last(audio, T, T - 1, embeddings=wrong))
    assert np.array_equal(last.logits, b.run(_audio_last(audio, T, T - 1)).logits)


def test_audio_requests_refused(engines, audio):
    b, T = engines[AUDIO_PRESET], len(audio["ids"])
    (s0, n0), (s1, n1) = audio["audio"]
    with pytest.raises(ValueError, match="audio block at position 6 .* straddles pieces 0 and 1"):
        b.run(_audio_prefill(audio, [0, s0 + 5, T], [(), (3,)])[0])
    with pytest.raises(ValueError, match="audio prompts cannot be split into micro-batches"):
        b.run(_audio_prefill(audio, [0, T], [(T - 1,)], ubatch=8)[0])
    with pytest.raises(ValueError, match="holds tokens other than the audio token"):
        b.run(_audio_prefill(audio, [0, T], [(T - 1,)], audio=[(s0 - 1, n0), (s1, n1)])[0])
    with pytest.raises(ValueError, match="2 audio block\\(s\\) but 1 audio input"):
        b.run(_audio_prefill(audio, [0, T], [(T - 1,)], audio_inputs=audio["inputs"][:1])[0])
    with pytest.raises(ValueError, match="audio clip 0 gives 13 soft tokens but its block at position 6 holds 18"):
        b.run(_audio_prefill(audio, [0, T], [(T - 1,)], audio_inputs=audio["inputs"][::-1])[0])
    with pytest.raises(ValueError, match="an audio prompt needs entry 'embeddings'"):
        b.run(Request("last", tokens=tup(audio["ids"]), entry="seq_id", seq_id=1, last_pos=3, audio=((s0, n0),)))
    with pytest.raises(ValueError, match="audio prompts are served .* not on 'full'"):
        b.run(Request("full", tokens=tup(audio["ids"]), audio=tuple(audio["audio"])))
    with pytest.raises(ValueError, match="no audio tower"):  # a checkpoint without audio_config
        engines["e2b-mini"].engine.audio_soft_tokens(audio["inputs"][0].features, audio["inputs"][0].mask)


@pytest.mark.parametrize("m", AUDIO_MUTANTS, ids=lambda m: m.name)
def test_audio_mutants_differ_on_an_audio_prompt(m, preset_dirs, audio, prompts):
    T = len(audio["ids"])
    req, expect = _audio_prefill(audio, [0, T], [range(T)])
    b = m.backend()
    b.open(preset_dirs[AUDIO_PRESET])
    try:
        diff = max_abs(b.run(req).logits, audio["logits"][expect])
    finally:
        b.close()
    assert diff > 1.0, (m.name, diff)  # measured: 17.6 (logit cap missing) to 46
    # and a no-op on an image prompt (no audio token there)
    assert _image_mutant_difference(m, preset_dirs, prompts, IMAGE_SET_PLE) < TOL
