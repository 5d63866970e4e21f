"""The gate on Gemma 4 Unified (the bundled 12b-mini): what its requests carry, the vision-mask rule a set
records and an engine is graded against, and engines that embed images and audio themselves.

The row-by-row grading of refimpl and numpy-engine on every bundled set, 12b-mini included, is in
tests/gate/backends/refimpl/test_refimpl_backend.py and tests/gate/selftest/test_numpy_engine.py; the mutants in
tests/gate/selftest/test_selftest.py.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from conformance.backends.refimpl_backend import RefimplBackend
from conformance.check import materialise
from conformance.check.profiles import PROFILES
from conformance.check.requests import build_request
from conformance.check.runner import run
from conformance.generate import generate_set
from conformance.protocol.types import ImageInput, Request
from conformance.protocol.wire import request_from_json, request_to_json
from conformance.selftest.backend import NumpyEngineBackend
from conformance.sets import load_set
from conformance.sets.bundled import bundled_sets

SET = next(p for p in bundled_sets() if p.name == "12b-mini")


@pytest.fixture(scope="module")
def fs():
    return load_set(SET)


@pytest.fixture(scope="module")
def model_dir(fs, tmp_path_factory):
    return materialise(fs, tmp_path_factory.mktemp("unified-gate"))


def test_the_set_records_its_rule_and_its_embedders(fs):
    m = fs.manifest
    assert m["oracle"]["vision_mask"] == "sliding-clamped" == m["images"]["vision_mask"]
    assert m["images"]["model"] == "embedder" and m["images"]["processor"]["model_patch_size"] == 12
    assert m["audio"]["feature_extractor"]["audio_samples_per_token"] == 640
    kinds = {c.base[0] for c in fs.cases}
    assert kinds >= {"A", "I", "S"} and len(fs.cases) == 112


def test_image_requests_carry_the_padded_patches(fs):
    media = fs.media("scaled")
    case = next(c for c in fs.cases if c.base == "I1" and c.kind == "prefill")
    req = build_request(case, fs.bases(), None, media)
    assert len(req.image_inputs) == len(req.images) == 2
    for (_, n), image in zip(req.images, req.image_inputs, strict=True):
        assert image.pixel_values.shape == (70, 3 * 12 * 12)  # max_soft_tokens rows of 12-px patches
        real = (image.positions != -1).all(axis=1)
        assert real.sum() == n and not image.pixel_values[~real].any()
        assert (image.positions[~real] == -1).all()
    grids = [tuple(image.positions[(image.positions != -1).all(axis=1)].max(axis=0) + 1) for image in req.image_inputs]
    assert grids == [(13, 5), (5, 13)]  # (x, y) extents: a wide and a tall image, transposed grids
    clip_case = next(c for c in fs.cases if c.base == "S0" and c.kind == "last")
    clip = build_request(clip_case, fs.bases(), None, media).audio_inputs[0]
    assert clip.features.shape[1] == 640 and clip.mask.all()


def test_image_inputs_survive_the_wire(tmp_path):
    image = ImageInput(np.random.default_rng(0).uniform(0, 1, (4, 12)), np.array([[0, 0], [1, 0], [-1, -1], [-1, -1]]))
    req = Request("last", tokens=(2, 9, 9, 8), entry="embeddings", seq_id=0, last_pos=3,
                  embeddings=np.zeros((4, 8)), images=((1, 2),), image_inputs=(image,))
    back = request_from_json(json.loads(json.dumps(request_to_json(req, tmp_path))), tmp_path)
    assert np.array_equal(back.image_inputs[0].pixel_values, image.pixel_values)
    assert np.array_equal(back.image_inputs[0].positions, image.positions)
    assert back.image_inputs[0].positions.dtype == np.int64


def _zero_image_rows(req: Request) -> Request:
    """The request with the image rows of its embeddings zeroed (every piece's, or the last request's)."""
    def zeroed(x, lo):
        x = np.array(x, copy=True)
        for start, n in req.images:
            a, b = max(start - lo, 0), min(start + n - lo, len(x))
            if a < b:
                x[a:b] = 0.0
        return x
    if req.kind == "last":
        return dataclasses.replace(req, embeddings=zeroed(req.embeddings, 0))
    pieces, lo = [], 0
    for piece in req.pieces:
        pieces.append(dataclasses.replace(piece, embeddings=zeroed(piece.embeddings, lo)))
        lo += len(piece.tokens)
    return dataclasses.replace(req, pieces=tuple(pieces))


@pytest.mark.parametrize("backend", [RefimplBackend, NumpyEngineBackend])
def test_image_tower_engines_do_not_read_the_given_image_rows(fs, model_dir, backend):
    """refimpl and numpy-engine claim image_tower: with the image rows of a request's embeddings zeroed
    they answer as with the rows given (they embed the request's patches), on every image case."""
    b = backend()
    assert b.capabilities.image_tower
    b.open(model_dir)
    media = fs.media("scaled")
    cases = [c for c in fs.cases if c.base in ("I0", "I1")]
    assert len(cases) == 30
    for case in cases[::4]:
        req = build_request(case, fs.bases(), None, media)
        assert req.images and req.image_inputs
        a, z = b.run(req), b.run(_zero_image_rows(req))
        assert np.abs(a.logits - z.logits).max() < 1e-12, case.id
    b.close()


def test_each_rule_passes_its_own_set_only(tmp_path):
    """A set generated with --vision-mask all-unclamped records that rule; refimpl with the same rule
    passes it, with the default rule fails exactly its image cases (and the default set the other way)."""
    out = generate_set(tmp_path / "rule-a", preset="12b-mini", vision_mask="all-unclamped", workers=1, cases="images")
    rule_a = load_set(out)
    assert rule_a.manifest["oracle"]["vision_mask"] == "all-unclamped"
    for mask, want in (("all-unclamped", "pass"), ("sliding-clamped", "fail")):
        result = run(RefimplBackend(vision_mask=mask), [rule_a], PROFILES["exact-f64"], workdir=tmp_path)
        assert {c.status for c in result.cases} == {want}, mask
    with pytest.raises(ValueError, match="vision_mask must be one of sliding-clamped, all-unclamped"):
        RefimplBackend(vision_mask="all")
