"""Fixture sets (conformance/sets/, conformance/generate/) and the case matrix (conformance/generate/matrix.py).

The central check: every row a case expects (a row of its base's stored logits, picked by
``row_groups``) equals what a fresh oracle computes when it is driven exactly as the case's request
says: one forward over the prompt, the requested rows, the pieces and micro-batches through one
``KVCache``, embeddings input, separate caches per packed sequence, then single-token decode. This
validates the row-spec mapping independently of the generator.

Also: verification with recompute, the manifest a run writes, refusal to overwrite, atomicity, prompts
JSONL, the bundled sets (loadable, verified, up to date with the generator), and the reproduction of synthetic
checkpoints. Reading a set (a case's rows, the integrity checks against tampering) is
tests/gate/sets/test_set_integrity.py.

Run as a script to regenerate the bundled sets (with the transformers cross-check when torch and
transformers are installed)::

    .venv/bin/python tests/gate/generate/test_generate_sets.py --regenerate-bundled [PRESET ...]
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from conformance.check import materialise
from conformance.check.requests import build_request, response_groups
from conformance.generate import RECOMPUTE_BOUND, PromptError, generate_set, load_prompts, verify_set
from conformance.generate.matrix import generate_cases
from conformance.protocol import MtpResponse, Request, Response, required_capabilities
from conformance.sets import CASES, MANIFEST, FixtureError, bundled_sets, load_set, sha256_file
from conformance.sets.case import GENERATION_STEPS, TIE_MARGIN, check_case, row_groups
from refimpl.assistant import Drafter
from refimpl.model import Gemma4, KVCache
from refimpl.mtp import assisted_greedy, run_rounds
from refimpl.multimodal import MultimodalInputs, load_multimodal_tokens
from refimpl.synth import PRESETS

BUNDLED = list(PRESETS)  # one bundled set per preset
MLX_SET = "e2b-mini-mlx-q4"  # and the MLX quantised set, its checkpoint shipped (scripts/bundle-mlx-set.py)
# and llama.cpp's own GGUF files, shipped (scripts/bundle-gguf-set.py): set -> (convention, stored types)
GGUF_SETS = {"e2b-256-mini-q4km": ("ggml-cpu/x86/f16-kv/gelu-table", {"Q4_K", "Q6_K", "F32"}),
             "e2b-mini-q4-0": ("ggml-cpu/x86/gelu-table", {"Q4_0", "Q8_0", "F16", "F32"})}
# and the video matrices of a vision preset with PLE (frames causal) and of Gemma 4 Unified (frames bidirectional on
# sliding layers): set -> preset (conformance/generate/video.py)
VIDEO_SETS = {"e2b-vision-mini-video": "e2b-vision-mini", "12b-mini-video": "12b-mini"}

ROW_BOUND = 1e-10  # stored row vs the oracle driven as the request says (different chunking: float64 rounding)
REPO = Path(__file__).resolve().parents[3]
PROMPTS_PRESET = "e4b-mini"
BASE_B = "base-B.safetensors"  # one base's file in a set
PROMPT_LINES = [
    {"text": "hello world, what is the cache?", "id": "raw"},
    {"text": "Why does the sliding window need a cache?", "chat": True},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a token?"}]},
    {"tokens": [2, 100, 200, 300, 400, 101, 102, 103, 104, 105, 106, 107, 108]},
    {"tokens": [2]},
]


# ----------------------------------------------------------------------------------------------
# the oracle, driven exactly as a request says


def _forward(model, tokens, rows, cache, embeddings=None, images=(), offset=0, audio=()):
    """One call. ``images``/``audio``: the request's image/audio blocks (prompt positions); ``offset``:
    the call's first prompt position. Image and audio positions take the pad id (PLE); image positions
    on vision-bidirectional checkpoints also a block id each (audio stays causal)."""
    ids = np.asarray(tokens, dtype=np.int64)
    blocks = np.full(len(ids), -1)
    for b, (a, n) in enumerate(images):
        inside = slice(max(a - offset, 0), max(min(a + n - offset, len(ids)), 0))
        ids[inside] = model.cfg.pad_token_id
        blocks[inside] = b
    for a, n in audio:
        ids[max(a - offset, 0):max(min(a + n - offset, len(ids)), 0)] = model.cfg.pad_token_id
    bidirectional = model.cfg.use_bidirectional_attention == "vision" and bool(images)
    return model.forward(ids, rows=list(rows), cache=cache, embeddings=embeddings,
                         vision_blocks=blocks if bidirectional else None)


def _decode(model, cache, tokens):
    out = [model.forward([int(t)], rows="last", cache=cache) for t in tokens]
    return np.concatenate(out) if out else None


def oracle_answer(model, request) -> Response:
    """What an exact backend answers: a fresh cache per request (per sequence for multi); MTP requests
    through refimpl.mtp's teacher-forced rounds (mode rounds) or its own assisted run (mode generate)."""
    if request.kind == "mtp" and request.mtp_batch:  # batched: each sequence's solo run
        solo = [oracle_answer(model, Request(kind="mtp", tokens=p, drafter=request.drafter, mtp=m))
                for p, m in zip(request.sequences, request.mtp_batch, strict=True)]
        return Response(np.concatenate([r.logits for r in solo]), mtp_batch=[r.mtp for r in solo])
    if request.kind == "mtp":
        spec, drafter = request.mtp, Drafter(request.drafter)
        inputs = None
        if request.images or request.audio:  # MTP after media: the request's rows, pad ids at the blocks
            ids = np.asarray(request.tokens, dtype=np.int64)
            blocks = np.full(len(ids), -1)
            for b, (a, n) in enumerate(request.images):
                ids[a:a + n], blocks[a:a + n] = model.cfg.pad_token_id, b
            for a, n in request.audio:
                ids[a:a + n] = model.cfg.pad_token_id
            vision = model.cfg.use_bidirectional_attention == "vision" and bool(request.images)
            inputs = MultimodalInputs(ids, np.asarray(request.embeddings), blocks if vision else None,
                                      load_multimodal_tokens(Path(request.drafter).parent).placeholders)
        run = (run_rounds(model, drafter, request.tokens, [(r.token, r.drafts, r.accepted) for r in spec.rounds],
                          spec.convention, inputs=inputs) if spec.mode == "rounds" else
               assisted_greedy(model, drafter, request.tokens, spec.max_new_tokens, spec.num_drafts, spec.convention,
                               inputs=inputs))
        return Response(run.prefill_logits, mtp=MtpResponse(
            run.output, [r.accepted for r in run.rounds], [r.draft_argmax for r in run.rounds],
            [r.draft_logits for r in run.rounds], [r.verify_logits for r in run.rounds]))
    if request.kind == "multi":
        rows, decodes = [], []
        for k, seq in enumerate(request.sequences):
            cache = KVCache()
            rows.append(_forward(model, seq, [len(seq) - 1], cache))
            decodes.append(_decode(model, cache, request.decode[k]) if request.decode else None)
        return Response(np.concatenate(rows), decodes if request.decode else None)
    cache = KVCache()
    if request.kind == "full":
        logits = _forward(model, request.tokens, range(len(request.tokens)), cache)
    elif request.kind == "last":
        logits = _forward(model, request.tokens, [request.last_pos], cache, request.embeddings, request.images,
                          audio=request.audio)
    else:
        out, offset = [], 0
        for piece in request.pieces:
            n = len(piece.tokens)
            step = request.ubatch or n
            for start in range(0, n, step):  # every micro-batch its own call; some have no output row
                local = [r - start for r in piece.rows if start <= r < start + step]
                emb = None if piece.embeddings is None else piece.embeddings[start:start + step]
                out.append(_forward(model, piece.tokens[start:start + step], local, cache, emb, request.images,
                                    offset + start, request.audio))
            offset += n
        logits = np.concatenate(out)
    assert cache.length == sum(len(p.tokens) for p in request.pieces) if request.kind == "prefill" \
        else cache.length == len(request.tokens)
    return Response(logits, _decode(model, cache, request.decode) if request.decode else None)


def top2_margin(row: np.ndarray) -> float:
    """Top-1 minus top-2 logit of one row (computed here, independently of the set's row summaries)."""
    top = np.sort(np.asarray(row, dtype=np.float64))[-2:]
    return float(top[1] - top[0])


def expected_groups(case, base_logits):
    return [np.stack([base_logits[r.base][r.position] for r in rows]) if rows else np.zeros((0, 0))
            for _, rows in row_groups(case)]


# ----------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPT_LINES[:2]) + "\n\n"
                    + "\n".join(json.dumps(p) for p in PROMPT_LINES[2:]) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def sets(tmp_path_factory, prompts_file) -> dict[str, Path]:
    """One generated set per preset (seed 0); the PROMPTS_PRESET one with user prompts."""
    root = tmp_path_factory.mktemp("sets")
    return {
        p: generate_set(root / p, preset=p, seed=0, prompts=prompts_file if p == PROMPTS_PRESET else None,
                        cases=bundled_cases(p), store="logits")
        for p in BUNDLED
    }


@pytest.fixture(scope="module")
def small_set(sets) -> Path:
    return sets["31b-mini"]


def bundled_cases(preset: str) -> str:
    """The bundled set of a vision (audio) preset holds the image (audio) matrix only (its text model is a
    text preset's)."""
    if PRESETS[preset].get("assistant"):
        return "mtp"  # the MTP matrix only: its target is another preset's
    if PRESETS[preset].get("family") == "gemma4_unified":
        return "all"  # its own decoder: the text matrix, and the image and audio matrices of its embedders
    if PRESETS[preset].get("audio"):
        return "audio"
    return "images" if PRESETS[preset].get("vision") else "text"


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------------------------------------
# expected rows == the oracle driven by the request


@pytest.mark.parametrize("preset", BUNDLED)
def test_expected_rows_equal_the_oracle_run_directly(sets, preset, tmp_path):
    fs = load_set(sets[preset])
    model_dir = materialise(fs, tmp_path)
    model = Gemma4(model_dir)  # a fresh model, regenerated from preset and seed
    drafter = fs.drafter_dir(model_dir)
    # an MTP base's rows: rebuilt from the stored states through the two heads, not the logits of the run
    mtp_logits = fs.mtp_rows(model, Drafter(drafter))[0] if drafter is not None else {}
    bases, base_logits = fs.bases(), {**fs.base_logits(), **mtp_logits}
    kinds = set()
    for case in fs.cases:
        request = build_request(case, bases, model.embed, fs.media(), drafter)
        got = response_groups(case, oracle_answer(model, request))
        want = expected_groups(case, base_logits)
        assert len(got) == len(want), case.id
        for g, w, (name, rows) in zip(got, want, row_groups(case), strict=True):
            assert g.shape == (len(rows), model.cfg.vocab_size), (case.id, name)
            err = float(np.max(np.abs(g - w))) if rows else 0.0
            assert err <= ROW_BOUND, f"{case.id} {name}: {err}"
        kinds.add((case.kind, case.entry, len(case.pieces) > 1, case.ubatch))
    media = {("last", "embeddings", False, None), ("prefill", "embeddings", False, None),
             ("prefill", "embeddings", True, None)}
    if bundled_cases(preset) == "mtp":  # and with a tower the cases of the media bases MTP after media reads
        assert kinds - media == {("mtp", "plain", False, None)}
        return
    if bundled_cases(preset) in ("images", "audio"):
        assert kinds == media
        return
    assert {("full", "plain", False, None), ("last", "plain", False, None), ("last", "seq_id", False, None),
            ("last", "embeddings", False, None), ("prefill", "plain", False, None), ("prefill", "plain", False, 5),
            ("prefill", "plain", True, None), ("prefill", "plain", True, 5), ("multi", "plain", False, None)} <= kinds


def test_cases_are_structurally_sound_and_annotated(sets):
    for preset, path in sets.items():
        fs = load_set(path)
        bases, base_logits = fs.bases(), fs.base_logits()
        lengths = {b: len(t) for b, t in bases.items()}
        margins = fs.router_margins()
        assert bool(margins) == PRESETS[preset].get("enable_moe_block", False)
        for case in fs.cases:
            assert check_case(case, lengths, {**fs.image_blocks(), **fs.audio_blocks()}) == []
            assert case.id.startswith(f"{preset}/{case.kind}/")
            if case.kind == "mtp":
                continue  # their rows and margins: tests/gate/check/test_mtp_sets.py
            # ties: exactly the rows whose oracle top-2 margin is below TIE_MARGIN
            labels = {r.label: top2_margin(base_logits[r.base][r.position]) for _, rows in row_groups(case)
                      for r in rows}
            assert [t[0] for t in case.ties] == [k for k, m in labels.items() if m < TIE_MARGIN]
            for label, m in case.ties:
                assert m == pytest.approx(labels[label], abs=1e-12)
            if margins:
                assert case.moe_min_margin is not None and case.moe_min_margin >= 0
            else:
                assert case.moe_min_margin is None
            if case.generation:
                for _, rows in row_groups(case):
                    for r in rows:
                        assert r.golden_token == int(bases[r.base][r.position + 1])
                        assert r.golden_token == int(np.argmax(base_logits[r.base][r.position]))
            # the request needs exactly the capabilities the tags say
            req = build_request(case, bases, lambda ids: np.zeros((len(ids), 64)), fs.media())
            need = required_capabilities(req)
            assert ("interior_rows" in need) == (case.kind == "last" and "interior" in case.features)
            assert ("ubatch" in need) == ("ubatch" in case.features)
            assert ("chunked_prefill" in need) == ("chunked" in case.features)
            assert "decode" in need


def test_case_matrix_counts_and_tags(sets):
    fs = load_set(sets["e2b-mini"])
    W = 8
    by_kind: dict[str, int] = {}
    for c in fs.cases:
        by_kind[c.kind] = by_kind.get(c.kind, 0) + 1
    assert by_kind == {"full": 2, "last": 25, "prefill": 22, "multi": 3}
    # several micro-batch sizes: none, one token per micro-batch, U, and wider than the window
    assert {c.ubatch for c in fs.cases if c.kind == "prefill"} == {None, 1, 5, W + 1}
    lasts = [c for c in fs.cases if c.kind == "last" and not c.generation]
    assert {(c.entry, c.length, c.last_pos) for c in lasts} == {
        (e, T, p) for e in ("plain", "seq_id", "embeddings") for T in (W - 1, W, W + 1, 2 * W + 3)
        for p in (T - 1, T // 2)}
    assert {c.entry: c.base for c in lasts} == {"plain": "A", "seq_id": "B", "embeddings": "C"}
    assert all(c.seq_id and c.seq_id > 0 for c in lasts if c.entry != "plain")
    assert len({c.seq_id for c in lasts if c.entry != "plain"}) > 3
    tags = {t for c in fs.cases for t in c.features}
    assert {"plain", "seq_id", "embeddings", "interior", "window-1", "window", "window+1", "2window+3", "ubatch",
            "no-output-ubatch", "chunked", "chunk>window", "multi", "decode", "generation", "ple", "kv-shared",
            "double-wide", "softcap", "mqa"} <= tags
    assert "moe" not in tags and "gqa" not in tags
    moe_tags = {t for c in load_set(sets["26b-a4b-mini"]).cases for t in c.features}
    assert {"moe", "k=v", "gqa", "mqa"} <= moe_tags
    gen = [c for c in fs.cases if c.generation]
    assert len(gen) == 1 and gen[0].decode_len == GENERATION_STEPS - 1 and len(gen[0].golden_tokens) == GENERATION_STEPS
    multi = [c for c in fs.cases if c.kind == "multi"]
    assert [len(c.sequences) for c in multi] == [1, 2, 3]
    for c in multi:
        assert len({b for b, *_ in c.sequences}) == len(c.sequences)
        assert len({s for _, _, s, _ in c.sequences}) == len(c.sequences)


def test_generate_cases_small_window(micro_factory):
    """A window of 3 (micro config without a tokenizer, so an external model with random base G)."""
    from helpers import micro_config

    from refimpl.config import load_config

    cfg = load_config(micro_factory(micro_config(sliding_window=3)))
    bases = {b: [2] + [5] * 47 for b in "ABC"}
    bases["G"] = [2, 5, 6] + [7] * GENERATION_STEPS
    cases = generate_cases("m", cfg, bases)
    assert len({c.id for c in cases}) == len(cases)
    lengths = {b: len(t) for b, t in bases.items()}
    assert all(check_case(c, lengths) == [] for c in cases)
    with pytest.raises(ValueError, match="base A has 10 tokens"):
        generate_cases("m", cfg, {**bases, "A": [2] * 10})


# ----------------------------------------------------------------------------------------------
# verification (tampering: tests/gate/sets/test_set_integrity.py)


def test_verify_clean_and_recompute(small_set, tmp_path):
    assert verify_set(small_set) == []
    assert verify_set(small_set, recompute=True, workdir=tmp_path) == []


def test_manifest_contents(sets):
    m = json.loads((sets["e2b-mini"] / MANIFEST).read_text())
    assert m["schema"] == "gemma4-conformance/fixtures" and m["schema_version"] == 2 and m["storage"] == "logits"
    assert m["name"] == "e2b-mini" and m["version"] == "1.0.0"
    prov = m["provenance"]
    assert {"command", "refimpl_version", "numpy_version", "python_version", "created", "cross_checks"} <= set(prov)
    assert prov["created"].endswith("Z")
    [check] = prov["cross_checks"]  # no cross_check hook given: only the oracle's own consistency check
    assert check["implementation"].startswith("refimpl KV cache") and check["agreement"] < 1e-11
    assert m["model"]["kind"] == "synthetic" and m["model"]["preset"] == "e2b-mini" and m["model"]["seed"] == 0
    assert set(m["model"]["sha256"]) == {"config.json", "model.safetensors", "tokenizer.model"}
    assert m["oracle"] == {"dtype": "float64", "embed_scale": "exact"}
    files = [CASES] + [f"base-{b}.safetensors" for b in "ABCG"]
    assert sorted(m["files"]) == sorted(files)
    assert sorted(os.listdir(sets["e2b-mini"])) == sorted([MANIFEST, *files])  # the model is not copied


# ----------------------------------------------------------------------------------------------
# writing: refusal, atomicity, prompts, external models, cross checks


def test_refuses_to_overwrite(small_set):
    before = {f: sha256_file(small_set / f) for f in os.listdir(small_set)}
    with pytest.raises(FixtureError, match="already exists; fixture sets are never overwritten"):
        generate_set(small_set, preset="31b-mini")
    assert {f: sha256_file(small_set / f) for f in os.listdir(small_set)} == before


def test_empty_directory_is_accepted(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert verify_set(generate_set(out, preset="31b-mini")) == []


@pytest.mark.parametrize("fail_at", [1, 3, "write"])
def test_generation_is_atomic(tmp_path, fail_at):
    out = tmp_path / "sets" / "x"
    seen = []

    def progress(done, total, label):
        seen.append((done, total, label))
        if done == fail_at or label == fail_at:
            raise KeyboardInterrupt("simulated crash")

    with pytest.raises(KeyboardInterrupt):
        generate_set(out, preset="31b-mini", progress=progress)
    assert not out.exists()
    # no temporary directory left either; only the finished jobs, kept for a rerun to resume (none before one)
    assert os.listdir(tmp_path / "sets") == ([] if fail_at == 1 else [".x.partial"])
    assert seen[-1][0] <= seen[-1][1]


def test_progress_reports_every_step(tmp_path):
    seen = []
    generate_set(tmp_path / "x", preset="31b-mini", progress=lambda d, t, label: seen.append((d, t, label)))
    assert [d for d, _, _ in seen] == list(range(1, len(seen) + 1))
    assert all(t == len(seen) for _, t, _ in seen)
    assert seen[0][2] == "model" and seen[-1][2] == "write"


def test_prompts_jsonl(sets, prompts_file):
    entries = load_prompts(prompts_file)
    assert [e["kind"] for e in entries] == ["text", "text", "messages", "tokens", "tokens"]
    fs = load_set(sets[PROMPTS_PRESET])
    bases = fs.bases()
    assert {f"P{k}" for k in range(len(PROMPT_LINES))} <= set(bases)
    info = fs.manifest["bases"]
    from refimpl.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(materialise(fs, prompts_file.parent / "m"))
    want = [tok.encode(PROMPT_LINES[0]["text"]),
            tok.encode_chat([{"role": "user", "content": PROMPT_LINES[1]["text"]}]),
            tok.encode_chat(PROMPT_LINES[2]["messages"]), PROMPT_LINES[3]["tokens"], PROMPT_LINES[4]["tokens"]]
    for k, ids in enumerate(want):
        b = f"P{k}"
        assert bases[b][:len(ids)].tolist() == ids and info[b]["prompt_length"] == len(ids)
        assert len(bases[b]) == len(ids) + 3
        assert "line" in info[b]["where"]
        mine = [c for c in fs.cases if c.base == b]
        assert all("prompt" in c.features and c.decode_len == 3 for c in mine)
        assert len(mine) == (4 if len(ids) >= 3 else 2)  # a 1-token prompt: one last row, one prefill
    assert info["P0"]["id"] == "raw"


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 2: not valid JSON"),
    ('["a"]', "line 2: a prompt must be a JSON object"),
    ('{"text": "a", "tokens": [1]}', "line 2: a prompt needs exactly one of 'text', 'messages', 'tokens' (got "
                                     "text, tokens)"),
    ('{"prompt": "a"}', "line 2: unknown key 'prompt'"),
    ('{"text": ""}', "line 2: 'text' must be a non-empty string"),
    ('{"tokens": [2, -1]}', "line 2: 'tokens' must be a non-empty list of non-negative integers"),
    ('{"messages": [{"role": "user"}]}', "line 2: message 0 must be an object with string 'role' and 'content'"),
    ('{"tokens": [2], "chat": true}', "line 2: 'chat' only applies to 'text'"),
])
def test_bad_prompt_lines(tmp_path, line, message):
    f = tmp_path / "p.jsonl"
    f.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(PromptError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_prompts(f)
    with pytest.raises(PromptError):
        generate_set(tmp_path / "out", preset="31b-mini", prompts=f)
    assert not (tmp_path / "out").exists()


def test_prompt_problems_found_with_the_model(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"text": "fine"}\n\n{"tokens": [2, 512]}\n')
    with pytest.raises(PromptError, match=r"p.jsonl line 3: token id 512 is outside the vocabulary \[0, 512\)"):
        generate_set(tmp_path / "out", preset="31b-mini", prompts=f)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(PromptError, match="holds no prompt"):
        load_prompts(tmp_path / "empty.jsonl")
    assert sorted(os.listdir(tmp_path)) == ["empty.jsonl", "p.jsonl"]


def test_external_model_without_tokenizer(micro_factory, tmp_path):
    from helpers import micro_config

    model_dir = micro_factory(micro_config(sliding_window=3, num_hidden_layers=4))
    with pytest.raises(PromptError, match="only 'tokens' prompts work"):
        generate_set(tmp_path / "x", model_dir=model_dir, prompts=[{"text": "hi"}])
    out = generate_set(tmp_path / "ext", model_dir=model_dir, prompts=[[2, 7, 9, 11]], version="2.1.0-rc.1")
    fs = load_set(out)
    m = fs.manifest["model"]
    assert m["kind"] == "external" and m["path"] == str(Path(model_dir).resolve())
    assert set(m["sha256"]) == {"config.json", "model.safetensors"}
    assert fs.name == "ext" and fs.version == "2.1.0-rc.1" and fs.manifest["bases"]["G"]["source"] == "random"
    assert materialise(fs, tmp_path / "w") == Path(model_dir).resolve()
    model = Gemma4(model_dir)
    assert fs.storage == "hidden"  # the default: the logits are rebuilt through the head
    bases, logits = fs.bases(), fs.oracle_logits(model, tmp_path / "rebuilt")
    for case in fs.cases:
        got = response_groups(case, oracle_answer(model, build_request(case, bases, model.embed)))
        for g, w in zip(got, expected_groups(case, logits), strict=True):
            assert np.max(np.abs(g - w)) <= ROW_BOUND if w.size else g.shape[0] == 0
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    (Path(model_dir) / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))
    with pytest.raises(FixtureError, match="config.json in the checkpoint directory .* differs from the set's"):
        materialise(fs, tmp_path / "w")


def test_cross_check_hook(tmp_path):
    calls = []

    def check(model_dir, bases, base_logits):
        calls.append((model_dir, sorted(bases)))
        assert (model_dir / "config.json").is_file()
        return {"implementation": "twin", "agreement": 0.0, "detail": "the oracle against itself"}

    fs = load_set(generate_set(tmp_path / "a", preset="31b-mini", cross_check=check, command="make fixtures"))
    assert calls and calls[0][1] == ["A", "B", "C", "G"]
    prov = fs.manifest["provenance"]
    assert prov["command"] == "make fixtures"
    assert [c["implementation"] for c in prov["cross_checks"]][1:] == ["twin"]
    fs = load_set(generate_set(tmp_path / "b", preset="31b-mini", cross_check=lambda *a: None))
    assert len(fs.manifest["provenance"]["cross_checks"]) == 1  # not run: not recorded
    with pytest.raises(FixtureError, match="cross_check must return"):
        generate_set(tmp_path / "c", preset="31b-mini", cross_check=lambda *a: {"agreement": "good"})
    assert sorted(os.listdir(tmp_path)) == [".c.partial", "a", "b"]  # the finished jobs, kept for a rerun


def test_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="exactly one of"):
        generate_set(tmp_path / "x")
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        generate_set(tmp_path / "x", preset="nope")
    with pytest.raises(ValueError, match="not a semantic version"):
        generate_set(tmp_path / "x", preset="31b-mini", version="v1")
    with pytest.raises(ValueError, match="set name 'a b'"):
        generate_set(tmp_path / "x", preset="31b-mini", name="a b")
    with pytest.raises(ValueError, match="not a directory"):
        generate_set(tmp_path / "x", model_dir=tmp_path / "none")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    from refimpl.errors import RefimplError

    with pytest.raises(RefimplError):
        generate_set(tmp_path / "x", model_dir=tmp_path / "ckpt")
    assert os.listdir(tmp_path) == ["ckpt"]
    assert not issubclass(PromptError, FixtureError) and issubclass(PromptError, ValueError)


# ----------------------------------------------------------------------------------------------
# synthetic checkpoints and the bundled sets


def test_synthetic_model_is_reproduced(small_set, tmp_path):
    fs = load_set(small_set)
    d = materialise(fs, tmp_path)
    for name, want in fs.manifest["model"]["sha256"].items():
        assert sha256_file(d / name) == want
    assert fs.warnings == []
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert materialise(fs, tmp_path) == d and (d / "model.safetensors").stat().st_mtime_ns == mtime  # reused

    path = _copy(small_set, tmp_path / "copy")
    m = json.loads((path / MANIFEST).read_text())
    m["model"]["sha256"]["model.safetensors"] = "f" * 64
    (path / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(FixtureError, match=r"could not be reproduced: model.safetensors .*Recorded with refimpl "
                                           r"0\.1\.0, numpy .*, python .*; found refimpl"):
        materialise(load_set(path), tmp_path / "w2")
    m["model"]["sha256"]["model.safetensors"] = fs.manifest["model"]["sha256"]["model.safetensors"]
    m["model"]["sha256"]["tokenizer.model"] = "e" * 64
    (path / MANIFEST).write_text(json.dumps(m))
    other = load_set(path)
    materialise(other, tmp_path / "w3")
    assert len(other.warnings) == 1 and "tokenizer.model differs" in other.warnings[0]


def test_bundled_sets_load_and_verify():
    paths = bundled_sets()
    assert [p.name for p in paths] == sorted([*BUNDLED, MLX_SET, *GGUF_SETS, *VIDEO_SETS])
    total = 0
    for p in paths:
        assert verify_set(p) == [], p
        fs = load_set(p)
        total += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        if p.name == MLX_SET:
            model = fs.manifest["model"]
            assert (model["kind"], model["path"], model["quantisation"]["format"]) == ("external", "checkpoint",
                                                                                     "mlx-affine")
            assert {(v["bits"], v["group_size"]) for v in model["quantisation"]["tensors"].values()} == {(4, 32)}
            assert len(fs.cases) == 52 and materialise(fs, p) == p / "checkpoint"
            continue
        if p.name in GGUF_SETS:
            model = fs.manifest["model"]
            assert (model["kind"], model["path"], model["quantisation"]["format"]) == ("external",
                                                                                     "checkpoint/model.gguf", "gguf")
            assert fs.activations == GGUF_SETS[p.name][0]
            assert {v["type"] for v in model["quantisation"]["tensors"].values()} == GGUF_SETS[p.name][1]
            assert len(fs.cases) == 52 and materialise(fs, p) == p / "checkpoint" / "model.gguf"
            continue
        if p.name in VIDEO_SETS:
            assert fs.manifest["model"] == {**fs.manifest["model"], "kind": "synthetic", "preset": VIDEO_SETS[p.name],
                                            "seed": 0}
            assert len(fs.cases) == 30 and all("video" in c.features for c in fs.cases) and len(fs.video_groups()) == 2
            continue
        assert fs.manifest["model"] == {**fs.manifest["model"], "kind": "synthetic", "preset": p.name, "seed": 0}
        kind = bundled_cases(p.name)  # "text", "images", "audio" or "all" (Gemma 4 Unified: every matrix)
        media_set = kind != "text"
        assert fs.name == p.name and len(fs.cases) >= (25 if media_set else 50)
        if kind == "mtp":  # the MTP matrix, and with a tower the media base(s) of MTP after media with their cases
            media_bases = {c.mtp.media for c in fs.cases if c.mtp is not None and c.mtp.media is not None}
            assert sum(bool(c.mtp_batch) for c in fs.cases) == 12  # batched: per mode and convention
            assert {c.base for c in fs.cases if c.kind != "mtp"} == media_bases <= {"I0", "S0"}
            assert bool(media_bases) == bool(PRESETS[p.name].get("vision") or PRESETS[p.name].get("unified_vision"))
        elif kind == "all":
            assert {f for c in fs.cases for f in c.features} >= {"image", "audio", "vision-blocks", "chunked"}
            assert not any("image" in c.features and "audio" in c.features for c in fs.cases)
        else:
            assert all(("image" in c.features) == (kind == "images") for c in fs.cases)
            assert all(("audio" in c.features) == (kind == "audio") for c in fs.cases)
        for check in fs.manifest["provenance"]["cross_checks"]:
            # the image and audio bases of the e2b-mini text model are ill-conditioned: a 1-ulp change of the
            # soft tokens moves its logits by up to 3.7e-12 (measured), and transformers agrees to 1.1e-11
            # (images) and 5.8e-12 (audio) there; elsewhere 1e-12
            assert check["agreement"] < (3e-11 if media_set else 2e-12), check
    # 23.4 MB measured: the 12 earlier sets (14.1 MB), e2b-256-mini (1.2 MB), e2b-mini-mlx-q4 with its checkpoint
    # (1.6 MB), e2b-256-mini-q4km with its GGUF file (5.6 MB), e2b-mini-q4-0 with its (0.9 MB); then the two video
    # sets (stored as hidden states; their frames' patches, 218 KB a frame, are most of them), 28.1 MiB; then the
    # media bases of MTP after media (12b-assistant-mini's I0 and S0, e2b-vision-assistant-mini's I0): 30.4 MiB
    assert total < 32 * 2**20


# test_bundled_sets_are_up_to_date compares the bundled sets (made on another machine: another CPU, other BLAS
# kernels and NumPy loops) with the sets the generator writes here. Everything but float data must be equal;
# float data only reproduces to its rounding, bounded as follows.
# * logits: RECOMPUTE_BOUND (1e-9 absolute), the bound verify_set(recompute=True) holds stored logits to; a
#   whole forward in float64 (u = 1.1e-16) of logits up to ~30. Measured across OpenBLAS's SkylakeX,
#   Haswell and Sandybridge kernels and NumPy's AVX-512 and AVX2 loops: up to 1.3e-11 on the image and audio
#   sets of the e2b-mini text model (which amplifies a 1-ulp change of the soft tokens ~1000x), up to 2.4e-12
#   on the text sets.
# * a tie's margin is the difference of two logits: twice that.
# * every other float tensor (soft tokens, merged embeddings, log-mel features, waveforms, pixel values,
#   router margins) and moe_min_margin (a difference of router probabilities): 1e-12 relative to the tensor's
#   scale (its largest |value|, at least 1), the project's bound for float64 rounding through a whole
#   miniature model (~4500 u); measured at most 1.9e-14 (the audio soft tokens).
# A changed case, token, row or input moves these by far more than the bounds.
TIE_BOUND = 2 * RECOMPUTE_BOUND
REL_BOUND = 1e-12


def _without_mtp_margins(case: dict, where: str) -> tuple[dict, list[float]]:
    """A case's JSON without the float margins of its MTP rounds (each round [token, drafts, accepted, argmax,
    draft margins, verify margins]), and those margins: computed floats, compared within their rounding, never
    bit for bit (another CPU's BLAS rounds them differently)."""
    if not case.get("mtp"):
        return case, []
    margins: list[float] = []
    rounds = []
    for r in case["mtp"]["rounds"]:
        assert len(r) == 6, where
        margins += list(r[4]) + list(r[5])
        rounds.append(r[:4] + [len(r[4]), len(r[5])])
    return case | {"mtp": case["mtp"] | {"rounds": rounds}}, margins


def _same_ties(a, b, where: str) -> None:
    """The same rows recorded as ties, in the same order, with margins equal within TIE_BOUND. A row whose margin
    is within TIE_BOUND under TIE_MARGIN may be recorded on one side only: the threshold decides on rounding
    there."""
    ma, mb = dict(a), dict(b)
    common = [label for label, _ in a if label in mb]
    assert common == [label for label, _ in b if label in ma], where
    for label in common:
        assert abs(ma[label] - mb[label]) <= TIE_BOUND, (where, label, ma[label], mb[label])
    for label, m in [t for t in a if t[0] not in mb] + [t for t in b if t[0] not in ma]:
        assert TIE_MARGIN - m <= TIE_BOUND, (where, label, m)


def test_bundled_sets_are_up_to_date(sets, tmp_path):
    """The bundled sets equal what the generator writes now: the same cases, tokens, tensors and manifest,
    float data to its rounding (the bounds above). The MLX quantised set is generated again from the checkpoint it
    ships (its recorded path, inside the set, aside), and so is the GGUF set, under its activation convention."""
    from refimpl.safetensors_io import TensorStore

    sets = {**sets, MLX_SET: generate_set(tmp_path / MLX_SET, model_dir=REPO / "fixtures" / MLX_SET / "checkpoint",
                                          name=MLX_SET, cases="text", store="logits"),
            **{name: generate_set(tmp_path / name, model_dir=REPO / "fixtures" / name / "checkpoint" / "model.gguf",
                                  name=name, cases="text", store="logits", activations=conv)
               for name, (conv, _) in GGUF_SETS.items()},
            **{name: generate_set(tmp_path / name, preset=preset, name=name, cases="videos", store="hidden")
               for name, preset in VIDEO_SETS.items()}}
    for p in bundled_sets():
        bundled, fresh = load_set(p), load_set(sets[p.name])
        mb, mf = (json.loads((d / MANIFEST).read_text()) for d in (p, sets[p.name]))
        prompt_bases = {b for b, info in mf["bases"].items() if info.get("source") == "prompt"}
        assert bool(prompt_bases) == (p.name == PROMPTS_PRESET)
        if p.name == PROMPTS_PRESET:  # the fresh one has user prompts on top
            fresh.cases = [c for c in fresh.cases if "prompt" not in c.features]
            for b in prompt_bases:
                del mf["bases"][b]
            mf["cases"] = len(fresh.cases)
        # cases: every field equal, the two float fields (ties' margins, moe_min_margin) to rounding
        assert [c.id for c in bundled.cases] == [c.id for c in fresh.cases], p.name
        for a, b in zip(bundled.cases, fresh.cases, strict=True):
            ja, jb = _without_mtp_margins(a.to_json(), a.id), _without_mtp_margins(b.to_json(), a.id)
            loose = {"ties": None, "moe_min_margin": None}
            assert ja[0] | loose == jb[0] | loose, a.id
            assert len(ja[1]) == len(jb[1]), a.id
            assert all(abs(x - y) <= TIE_BOUND for x, y in zip(ja[1], jb[1], strict=True)), a.id
            _same_ties(a.ties, b.ties, a.id)
            assert (a.moe_min_margin is None) == (b.moe_min_margin is None), a.id
            if a.moe_min_margin is not None:
                assert abs(a.moe_min_margin - b.moe_min_margin) <= REL_BOUND, (a.id, a.moe_min_margin, b.moe_min_margin)
        # tensors: the same names, dtypes and shapes; integers (tokens, image blocks, pixels, masks) equal
        fb, ff = (sorted(f for f in os.listdir(d) if f.startswith("base-")) for d in (p, sets[p.name]))
        extra = [f for f in ff if f not in fb]
        assert all(f[len("base-"):-len(".safetensors")] in prompt_bases for f in extra), extra
        assert [f for f in ff if f not in extra] == fb, p.name
        for f, name in ((g, n) for g in fb for n in TensorStore(p / g).names):
            sb, sf = TensorStore(p / f), TensorStore(sets[p.name] / f)
            assert sb.names == sf.names, (p.name, f)
            info, other = sb.infos[name], sf.infos[name]
            assert (info.dtype, info.shape) == (other.dtype, other.shape), name
            a, b = sb.raw(name), sf.raw(name)
            if a.dtype.kind != "f":
                assert np.array_equal(a, b), name
                continue
            scale = max(1.0, float(np.abs(a).max(initial=0.0)))
            bound = RECOMPUTE_BOUND if name in ("logits", "top_logits", "lse") else REL_BOUND * scale
            err = float(np.max(np.abs(a - b), initial=0.0))
            assert err <= bound, f"{name}: {err:.3g} > {bound:.3g}"
        # the manifest: equal but for the float data's digests (compared above) and provenance (when, by which
        # command, with which NumPy / Python, the cross-checks' rounding-level agreements)
        for m in (mb, mf):
            m.pop("files")
            m["provenance"] = {k: m["provenance"][k] for k in ("generator", "refimpl_version")}
            if p.name == MLX_SET or p.name in GGUF_SETS:
                m["model"].pop("path")  # inside the set in the bundle, where it was generated from here
        assert mb == mf, p.name


def test_bundled_sets_from_an_installed_layout(tmp_path):
    """bundled_sets() outside the source tree finds the installed data package: a copy of the package elsewhere,
    laid out as the wheel installs it (fixtures/ as conformance/bundled/), finds its own sets."""
    import subprocess

    pkg = tmp_path / "site" / "conformance"
    shutil.copytree(REPO / "conformance", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "fixtures", pkg / "bundled")
    code = ("import conformance.sets as f, sys; ps = f.bundled_sets(); "
            "assert all(str(p).startswith(sys.argv[1]) for p in ps), ps; print(len(ps))")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{REPO}"}
    out = subprocess.run([sys.executable, "-c", code, str(pkg)], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == len(BUNDLED) + 1 + len(GGUF_SETS) + len(VIDEO_SETS)  # MLX, GGUF and video sets too


@pytest.mark.hf
def test_hf_cross_check(small_set, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    fs = load_set(small_set)
    entries = hf_cross_check(materialise(fs, tmp_path), fs.bases(), fs.base_logits())
    assert entries and all(e["agreement"] < 2e-12 for e in entries)


# ----------------------------------------------------------------------------------------------
# the transformers cross-check and the bundled-set generator


def hf_cross_check(model_dir, bases, base_logits, images=None, audio=None):
    """transformers Gemma4ForCausalLM in float64 (tests/hf_reference.py) against the stored logits: a full
    forward over every base, and chunked prefill + decode through transformers' cache on base A. Image
    bases (``images``): Gemma4ForConditionalGeneration from the stored preprocessed images (see
    hf_image_cross_check). None when torch or transformers are missing."""
    try:
        import torch  # noqa: F401 - only: is it installed
        import transformers  # noqa: F401 - only: is it installed
    except ImportError:
        return None
    if not bases:
        # an MTP set: its rows are checked against transformers' assisted generation by tests/oracle/mtp/test_mtp_hf.py
        return []
    if json.loads((Path(model_dir) / "config.json").read_text()).get("model_type") == "gemma4_unified":
        return hf_unified_cross_check(model_dir, bases, base_logits, images or {}, audio or {})
    text = {b: ids for b, ids in bases.items() if b not in (images or {}) and b not in (audio or {})}
    return (hf_text_cross_check(model_dir, text, base_logits) if text else []) + \
        (hf_image_cross_check(model_dir, bases, base_logits, images) if images else []) + \
        (hf_audio_cross_check(model_dir, bases, base_logits, audio) if audio else [])


def hf_unified_cross_check(model_dir, bases, base_logits, images, audio):
    """transformers Gemma4UnifiedForConditionalGeneration in float64 (tests/hf_unified_reference.py) against
    the stored logits: every base in one forward with the rule-B mask dict of its static path (the set's
    rule, sliding-clamped), image bases from the stored padded patches and positions, audio bases from the
    stored raw frames (transformers' own embedders); chunked prefill and decode on base A."""
    import torch
    import transformers
    from hf_unified_reference import hf_logits, hf_logits_incremental, load_hf_unified

    torch.set_num_threads(1)
    hf = load_hf_unified(model_dir)
    worst = {"text": 0.0, "image": 0.0, "audio": 0.0}
    for b, ids in bases.items():
        kind = "image" if b in images else "audio" if b in audio else "text"
        imgs = [(p.pixel_values, p.positions) for p in images.get(b, ())]
        clips = [c.features[c.mask] for c in audio.get(b, ())]
        got = hf_logits(hf, [int(t) for t in ids], images=imgs, clips=clips, rule="sliding-clamped")
        worst[kind] = max(worst[kind], float(np.max(np.abs(got - base_logits[b]))))
    incremental = []  # (an MTP set's media bases have no base A)
    if "A" in bases:
        ids = [int(t) for t in bases["A"]]
        cuts = np.cumsum([3, 10, 1, 1, 13, len(ids) - 31, 1, 1]).tolist()
        inc = float(np.max(np.abs(hf_logits_incremental(hf, ids, cuts) - base_logits["A"])))
        incremental = [("DynamicCache", inc, f"chunked prefill and decode on base A, cuts {cuts}, max abs")]
    who = (f"transformers {transformers.__version__} Gemma4UnifiedForConditionalGeneration (eager, float64 with the "
           f"float32 spots made float64 by tests/hf_unified_reference.py; torch {torch.__version__})")
    return [{"implementation": who, "agreement": worst[k], "detail": d} for k, d in (
        ("text", "full forward over every text base, max abs"),
        ("image", f"every row of the image bases ({', '.join(images)}) from the stored padded patches and positions, "
                  "mm_token_type_ids and the static-cache mask dict (rule sliding-clamped), max abs"),
        ("audio", f"every row of the audio bases ({', '.join(audio)}) from the stored raw frames (transformers' "
                  "own embedder), max abs")) if (k == "text" and len(images) + len(audio) < len(bases))
        or (images if k == "image" else audio)] + [
        {"implementation": f"{who}, {what}", "agreement": a, "detail": d} for what, a, d in incremental]


def hf_audio_cross_check(model_dir, bases, base_logits, audio):
    """transformers Gemma4ForConditionalGeneration in float64 with its float32 spots patched (text and
    audio tower), fed the audio bases' ids, the stored log-mel features of every clip (padded to the
    longest, with input_features_mask) and mm_token_type_ids (3 at audio tokens): every row against the
    stored logits. transformers runs its own audio tower, so this checks the soft tokens too."""
    import hf_reference
    import torch
    import transformers
    import transformers.models.gemma4.modeling_gemma4 as mg
    from hf_reference import recompute_float64_buffers
    from hf_towers import audio_float64_exact, recompute_audio_buffers

    torch.set_num_threads(1)
    hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float64,
                                                                     attn_implementation="eager", use_safetensors=True)
    hf.eval()
    recompute_audio_buffers(torch, mg, hf)
    recompute_float64_buffers(hf)
    audio_token = hf.config.audio_token_id
    worst = 0.0
    for b, clips in audio.items():
        T = max(c.features.shape[0] for c in clips)
        x = np.zeros((len(clips), T, clips[0].features.shape[1]))
        mask = np.zeros((len(clips), T), dtype=bool)
        for j, c in enumerate(clips):
            x[j, :c.features.shape[0]] = c.features
            mask[j, :c.mask.shape[0]] = c.mask
        ids = np.asarray(bases[b], dtype=np.int64)
        with torch.no_grad(), audio_float64_exact(torch, mg, hf_reference):
            out = hf(input_ids=torch.from_numpy(ids[None]), input_features=torch.from_numpy(x),
                     input_features_mask=torch.from_numpy(mask),
                     mm_token_type_ids=torch.from_numpy(np.where(ids == audio_token, 3, 0)[None]), use_cache=False)
        worst = max(worst, float(np.max(np.abs(out.logits[0].numpy() - base_logits[b]))))
    who = (f"transformers {transformers.__version__} Gemma4ForConditionalGeneration (eager, float64 with the "
           "float32 spots of the text path and the audio tower made float64 by tests/hf_reference.py and "
           f"tests/oracle/towers/test_audio_tower.py; torch {torch.__version__})")
    return [{"implementation": who, "agreement": worst,
             "detail": f"every row of the audio bases ({', '.join(audio)}) from the stored log-mel features and "
                       "masks (transformers' own audio tower), with mm_token_type_ids, max abs"}]


def hf_image_cross_check(model_dir, bases, base_logits, images):
    """transformers Gemma4ForConditionalGeneration in float64 with its float32 spots patched (text and
    vision), fed the image bases' ids, pixel_values (padded to max_soft_tokens * k^2 patches as its
    processor does), image_position_ids and mm_token_type_ids: every row against the stored logits."""
    import json

    import hf_reference
    import torch
    import transformers
    import transformers.models.gemma4.modeling_gemma4 as mg
    from hf_reference import recompute_float64_buffers
    from hf_towers import recompute_vision_inv_freq, vision_float64_exact

    torch.set_num_threads(1)
    hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float64,
                                                                     attn_implementation="eager", use_safetensors=True)
    hf.eval()
    recompute_vision_inv_freq(torch, mg, hf)
    recompute_float64_buffers(hf)
    proc = json.loads((Path(model_dir) / "processor_config.json").read_text())["image_processor"]
    patches = proc["max_soft_tokens"] * proc["pooling_kernel_size"] ** 2
    image_token = hf.config.image_token_id
    worst = 0.0
    for b, processed in images.items():
        pv = np.zeros((len(processed), patches, processed[0].pixel_values.shape[1]))
        pos = np.full((len(processed), patches, 2), -1, dtype=np.int64)
        for j, pr in enumerate(processed):
            pv[j, :len(pr.pixel_values)] = pr.pixel_values
            pos[j, :len(pr.positions)] = pr.positions
        ids = np.asarray(bases[b], dtype=np.int64)
        with torch.no_grad(), vision_float64_exact(torch, mg, hf_reference):
            out = hf(input_ids=torch.from_numpy(ids[None]), pixel_values=torch.from_numpy(pv),
                     image_position_ids=torch.from_numpy(pos),
                     mm_token_type_ids=torch.from_numpy((ids == image_token).astype(np.int64)[None]),
                     use_cache=False)
        worst = max(worst, float(np.max(np.abs(out.logits[0].numpy() - base_logits[b]))))
    who = (f"transformers {transformers.__version__} Gemma4ForConditionalGeneration (eager, float64 with the "
           "float32 spots of the text and vision paths made float64 by tests/hf_reference.py and "
           f"tests/oracle/towers/test_vision_tower.py; torch {torch.__version__})")
    return [{"implementation": who, "agreement": worst,
             "detail": f"every row of the image bases ({', '.join(images)}) from the stored pixel_values and "
                       "positions (padded as the processor pads), with mm_token_type_ids, max abs"}]


def hf_text_cross_check(model_dir, bases, base_logits):
    import torch
    import transformers
    from hf_reference import hf_logits, hf_logits_incremental, load_hf_causal_lm

    torch.set_num_threads(1)
    model = load_hf_causal_lm(model_dir)
    full = max(float(np.max(np.abs(hf_logits(model, ids.tolist()) - base_logits[b]))) for b, ids in bases.items())
    ids = bases["A"].tolist()
    W = int(model.config.sliding_window)
    chunks = [3, W + 2, 1, 1, W + 5]
    chunks.append(len(ids) - sum(chunks) - 3)
    chunks += [1, 1, 1]
    inc = float(np.max(np.abs(hf_logits_incremental(model, ids, chunks) - base_logits["A"])))
    who = (f"transformers {transformers.__version__} Gemma4ForCausalLM (eager, float64 with the float32 spots "
           f"made float64 by tests/hf_reference.py; torch {torch.__version__})")
    return [
        {"implementation": who, "agreement": full, "detail": f"full forward over every base ({', '.join(bases)}), "
                                                               "max abs"},
        {"implementation": who + ", DynamicCache", "agreement": inc,
         "detail": f"chunked prefill and decode on base A, pieces {chunks}, max abs"},
    ]


def regenerate_bundled(presets=()) -> None:
    """Rewrite fixtures/<preset>/ (the bundled sets) for the given presets or video sets, or every one (seed 0)."""
    root = REPO / "fixtures"
    for preset in presets or [*BUNDLED, *VIDEO_SETS]:
        out = root / preset
        if out.exists():
            shutil.rmtree(out)
        video = {"preset": VIDEO_SETS[preset], "name": preset, "cases": "videos", "store": "hidden"} \
            if preset in VIDEO_SETS else None  # (hidden states: the frames' patches are most of the set)
        generate_set(out, **(video or {"preset": preset, "cross_check": hf_cross_check,
                                       "cases": bundled_cases(preset), "store": "logits"}),
                     seed=0,
                     command="python tests/gate/generate/test_generate_sets.py --regenerate-bundled",
                     progress=lambda d, t, label, p=preset: print(f"\r{p}: {d}/{t} {label:<20}", end="", flush=True))
        print(f"\r{preset}: {len(load_set(out).cases)} cases, "
              f"{sum(os.path.getsize(out / f) for f in os.listdir(out)) / 1e6:.2f} MB" + " " * 20)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--regenerate-bundled"] or any(p not in [*BUNDLED, *VIDEO_SETS] for p in sys.argv[2:]):
        sys.exit("usage: python tests/gate/generate/test_generate_sets.py --regenerate-bundled [PRESET ...] (presets: "
                 f"{', '.join([*BUNDLED, *VIDEO_SETS])})")
    regenerate_bundled(sys.argv[2:])
