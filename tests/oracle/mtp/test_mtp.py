"""Properties of the MTP oracle (``refimpl.assistant``, ``refimpl.mtp``) that hold whatever the weights.

* Greedy assisted decoding equals plain greedy decoding under every convention, with the drafter's own
  drafts and with forced ones (spec D21).
* The keys a drafter step attends to follow the spec's worked example (B8: W = 6, a 9-token prompt,
  3 drafts, rejections) under the ``transformers`` convention, and the clean conventions' ranges.
* While the context is shorter than W - 1 and no draft was rejected, every kv convention hands over the
  same keys, so round 1 of a short prompt has one set of drafter logits.
* Forced drafts fix the acceptance pattern: a draft equal to the target's greedy token is accepted.
* Bad drafter configs get a one-line error naming the field.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import FULL, SLIDING, micro_assistant, micro_checkpoint, micro_config

from refimpl import Gemma4
from refimpl.assistant import Drafter, parse_assistant_config
from refimpl.errors import ConfigError, InputError
from refimpl.generate import greedy_generate
from refimpl.mtp import CONVENTIONS, assisted_greedy
from refimpl.synth import ASSISTANT_DIR, write_checkpoint


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = write_checkpoint("e2b-assistant-mini", 0, tmp_path_factory.mktemp("e2b") / "m")
    return Gemma4(model), Drafter(model / ASSISTANT_DIR)


@pytest.fixture(scope="module")
def w6(tmp_path_factory):
    """A target with window 6 (the spec's worked example) and a dense drafter."""
    root = tmp_path_factory.mktemp("w6")
    cfg = micro_config(num_hidden_layers=4, layer_types=[SLIDING, FULL, SLIDING, FULL], num_kv_shared_layers=2,
                       sliding_window=6)
    return Gemma4(micro_checkpoint(root / "t", cfg, 3)), Drafter(micro_assistant(root / "d", cfg, 4))


def prompt_of(n: int, seed: int = 0, vocab: int = 500) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("n", [3, 12])
def test_assisted_equals_plain_greedy(pair, convention, n):
    target, drafter = pair
    prompt = prompt_of(n, n)
    plain = greedy_generate(target, prompt, 10).tokens
    assert assisted_greedy(target, drafter, prompt, 10, 3, convention).output == tuple(plain)


def test_forced_drafts_fix_the_acceptance(pair):
    target, drafter = pair
    prompt = prompt_of(9, 5)
    plain = list(greedy_generate(target, prompt, 12).tokens)
    V = target.cfg.vocab_size

    def wrong(t: int) -> int:
        return (t + 1) % V

    # round 1 accepts 2 of 3, round 2 all 3, round 3 none
    forced = [[plain[1], plain[2], wrong(plain[3])], [plain[4], plain[5], plain[6]], [wrong(plain[8]), 0, 0]]
    run = assisted_greedy(target, drafter, prompt, 12, 3, forced=forced)
    assert [r.accepted for r in run.rounds[:3]] == [2, 3, 0]
    assert [r.position for r in run.rounds[:4]] == [9, 12, 16, 17]
    assert [r.hidden_row for r in run.rounds[:4]] == [8, 11, 15, 16]  # last prompt row, then row n of each chunk
    assert run.output == tuple(plain)


def test_worked_example_keys(w6):
    """Spec B8 (transformers 5.24, W = 6, n = 9, k = 3): forced all-rejecting drafts."""
    target, drafter = w6
    prompt = prompt_of(9, 1, 64)
    plain = list(greedy_generate(target, prompt, 8).tokens)
    forced = [[(plain[1] + 1) % 64] * 3, [(plain[2] + 1) % 64] * 3]
    run = assisted_greedy(target, drafter, prompt, 8, 3, "transformers/P", forced=forced)
    r1, r2, r3 = run.rounds[:3]
    assert (r1.position, r1.hidden_row) == (9, 8)
    assert r1.keys[FULL] == tuple(range(0, 9)) and r1.keys[SLIDING] == tuple(range(2, 9))
    assert (r2.position, r2.hidden_row) == (10, 9)
    assert r2.keys[FULL] == tuple(range(0, 11)) and r2.keys[SLIDING] == tuple(range(6, 13))
    assert (r3.position, r3.hidden_row) == (11, 10)
    assert r3.keys[FULL] == tuple(range(0, 12)) and r3.keys[SLIDING] == tuple(range(7, 14))
    clean = assisted_greedy(target, drafter, prompt, 8, 3, "target-cache/P", forced=forced).rounds[1]
    assert clean.keys[FULL] == tuple(range(0, 10)) and clean.keys[SLIDING] == tuple(range(5, 10))
    rotating = assisted_greedy(target, drafter, prompt, 8, 3, "rotating/P", forced=forced).rounds[1]
    assert rotating.keys[SLIDING] == tuple(range(4, 10))


def test_short_clean_context_is_convention_free(w6):
    target, drafter = w6
    prompt = prompt_of(4, 2, 64)  # 4 < W - 1
    rounds = [assisted_greedy(target, drafter, prompt, 4, 3, c).rounds[0] for c in ("target-cache/P", "rotating/P",
                                                                                    "transformers/P")]
    for r in rounds[1:]:
        assert r.keys == rounds[0].keys
        assert np.abs(r.draft_logits - rounds[0].draft_logits).max() <= 1e-12
    shifted = assisted_greedy(target, drafter, prompt, 4, 3, "target-cache/P-1").rounds[0]
    assert shifted.query_position == 3 and np.abs(shifted.draft_logits - rounds[0].draft_logits).max() > 1e-3


def test_bad_assistant_configs_are_refused(tmp_path):
    base = json.loads((write_checkpoint("e2b-assistant-mini", 0, tmp_path / "m") / ASSISTANT_DIR
                       / "config.json").read_text())
    with pytest.raises(ConfigError, match="'num_centroids' \\(7\\) must divide the vocabulary \\(512\\)"):
        parse_assistant_config(dict(base, num_centroids=7))
    with pytest.raises(ConfigError, match="every layer of an assistant is KV-shared"):
        parse_assistant_config(dict(base, text_config=dict(base["text_config"], num_kv_shared_layers=2)))
    with pytest.raises(ConfigError, match="'hidden_size_per_layer_input' is 8; an assistant has no per-layer"):
        parse_assistant_config(dict(base, text_config=dict(base["text_config"], hidden_size_per_layer_input=8)))


def test_drafter_geometry_must_fit_the_target(tmp_path, pair):
    target, _ = pair
    cfg = micro_config()  # head_dim 4, not e2b-mini's 16
    drafter = Drafter(micro_assistant(tmp_path / "d", cfg, 0))
    with pytest.raises(InputError, match="backbone_hidden_size is 16, the target's hidden_size 64"):
        drafter.store_layers(target.cfg)
