"""The transformers backend (``conformance.backends.transformers.backend``).

* Through the harness, on a representative subset of the bundled cases (every request kind and entry
  point: full; last plain / seq_id / embeddings at the last and an interior row; output-row prefill
  with micro-batches, some without an output row; "none, then the last in the next call"; chunked
  prefill with pieces longer than the window; three sequences with interleaved decode) on a dense PLE /
  KV-sharing preset (e2b-mini) and a MoE preset (26b-a4b-mini), and all-features for float32:
  every case passes the ``fp32`` profile in float32 and float64, and the float64 rows stay within
  ``F64_BOUND`` of the oracle.
* With tests/hf_reference.py's float64 patches (transformers' float32 spots made float64) the same
  backend passes the same cases at ``exact-f64``: the backend's own plumbing (caches, logits_to_keep
  indices, micro-batches, per-layer inputs of the embeddings entry) adds nothing.
* Directly: an interior ``logits_to_keep`` row is the full forward's row; a micro-batch without an
  output row writes the cache; transformers' ``logits_to_keep=0`` means "all rows" (why the backend
  never passes it for a forward without output rows); the embeddings convention is "scaled"; both
  checkpoint layouts give the same logits (to float32 rounding); option and open errors give their exact
  messages.
* Image prompts (vision checkpoints e2b-vision-mini, 31b-vision-mini, as Gemma4ForConditionalGeneration):
  last rows inside / right after the image blocks, an output-row prefill and chunks split after the
  eoi, each with decode, equal the oracle within ``EXACT_BOUND`` with the float64 patches and pass
  ``fp32`` as shipped; the mask comes from transformers' ``create_masks_for_vision_model`` and each
  rule (mm_token_type_ids, from the sequence's start, the pad row of the per-layer inputs) matters.
* Audio prompts (e2b-audio-mini, as Gemma4ForConditionalGeneration): the same kinds of requests over two
  clips, the soft tokens computed by transformers' own audio tower from the clips' features, equal the
  oracle within ``EXACT_BOUND`` with the float64 patches (tests/oracle/towers/test_audio_tower.py's audio ones too) and
  pass ``fp32`` as shipped; the tower's output is used (zeroed given rows change nothing), the pad row
  matters, and float64 as shipped (whose audio tower does not run) takes the given rows.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_reference as H  # noqa: E402  (needs torch + transformers)
from helpers import max_abs, tup  # noqa: E402 - after the importorskip of torch

from conformance import registry  # noqa: E402 - after the importorskip of torch
from conformance.backends.transformers.backend import EXPECTATIONS_DIR, TransformersBackend  # noqa: E402 - after the importorskip
from conformance.backends.transformers.loading import load_gemma4_causal_lm  # noqa: E402 - after the importorskip
from conformance.check.expectations import load as load_expectations  # noqa: E402 - after the importorskip of torch
from conformance.check.profiles import PROFILES  # noqa: E402 - after the importorskip of torch
from conformance.check.runner import run as run_cases  # noqa: E402 - after the importorskip of torch
from conformance.protocol import Backend, BackendError, Piece, Request  # noqa: E402 - after the importorskip of torch
from conformance.sets import bundled_set  # noqa: E402 - after the importorskip of torch
from refimpl.synth import write_checkpoint  # noqa: E402 - after the importorskip of torch

pytestmark = pytest.mark.hf

# transformers float64 (float32 RMSNorm, attention softmax, RoPE angles, router softmax) against the
# float64 oracle. Measured over all 260 bundled cases: worst row max_abs 2.6e-4 with eager attention
# (e4b-mini full/B/T19 row 15, an ill-conditioned per-layer-input norm), 9.6e-5 with sdpa; 3.7e-5 on
# the subset below. float32: 3.1e-4 (eager) / 3.5e-4 (sdpa). The bound is twice the worst measured.
F64_BOUND = 5e-4
# the same backend with the float32 spots patched to float64: measured worst 1.6e-12 (all 260 cases)
EXACT_BOUND = 1e-11

SUBSET = (
    r"^(e2b-mini|26b-a4b-mini|all-features)/("
    r"full/A/T9"
    r"|last/(plain/A|seq_id/B|embeddings/C)/T9/pos(8|4)"
    r"|prefill/A/T19/rows-middle/ub5"
    r"|prefill/B/T20/none-then-last-17\+3"
    r"|prefill/C/T20/none-then-last-17\+3/ub5"
    r"|prefill/A/T21/chunks-11\+10"
    r"|prefill/C/T19/rows-all"
    r"|multi/A-T3\+B-T8\+C-T13"
    r")$"
)
SUBSET_SETS = ("e2b-mini", "26b-a4b-mini", "all-features")
ENTRIES = {"full", "last:plain", "last:seq_id", "last:embeddings", "prefill", "multi"}


def run_subset(backend, profile: str, tmp_path, select: str = SUBSET, sets=SUBSET_SETS):
    result = run_cases(backend, [bundled_set(s) for s in sets], PROFILES[profile], select=select, workdir=tmp_path)
    assert result.cases, "the subset selected no case"
    return result


def worst(result) -> float:
    return max(row["metrics"]["max_abs"] for case in result.cases for row in case.rows)


def failures(result) -> list[str]:
    return [f"{c.id}: {c.status} {c.message}" for c in result.cases if c.status != "pass"]


# ----------------------------------------------------------------------------------------------
# through the harness


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_subset_passes_fp32(dtype, tmp_path):
    backend = TransformersBackend(dtype=dtype)
    result = run_subset(backend, "fp32", tmp_path)
    assert not failures(result), failures(result)
    assert {c.entry for c in result.cases} == ENTRIES
    assert {c.set for c in result.cases} == set(SUBSET_SETS)
    assert len(result.cases) == 13 * len(SUBSET_SETS)
    if dtype == "float64":
        assert worst(result) < F64_BOUND
    by_id = {c.id.split("/", 1)[1]: c.executed for c in result.cases if c.set == "26b-a4b-mini"}
    common = {"dtype": dtype, "attn_implementation": "eager", "device": "cpu", "layout": "causal",
              "experts_implementation": "eager" if dtype == "float64" else "grouped_mm"}
    for executed in by_id.values():
        assert {k: executed[k] for k in common} == common
    # the row each forward kept, as logits_to_keep said
    assert by_id["full/A/T9"]["logits_to_keep"] == 0  # 0 = all rows
    assert by_id["last/plain/A/T9/pos8"]["logits_to_keep"] == 1
    assert by_id["last/seq_id/B/T9/pos4"]["logits_to_keep"] == [4]
    assert by_id["last/embeddings/C/T9/pos4"]["per_layer_inputs"] is None  # 26b-a4b-mini has no PLE
    e2b = {c.id: c.executed for c in result.cases if c.set == "e2b-mini"}
    assert e2b["e2b-mini/last/embeddings/C/T9/pos4"]["per_layer_inputs"] == "get_per_layer_inputs(token ids)"
    ub = by_id["prefill/A/T19/rows-middle/ub5"]
    assert [(u["tokens"], u["logits_to_keep"]) for u in ub["pieces"][0]["ubatches"]] == [
        (5, []), (5, 1), (5, []), (4, [])]  # row 9 closes its micro-batch: the integer form
    assert ub["state_len_after_prefill"] == 19
    none_then_last = by_id["prefill/B/T20/none-then-last-17+3"]["pieces"]
    assert [p["ubatches"][0]["logits_to_keep"] for p in none_then_last] == [[], 1]
    multi = by_id["multi/A-T3+B-T8+C-T13"]
    assert multi["state_len_after_prefill"] == [3, 8, 13]
    assert multi["caches"] == "one DynamicCache per seq_id"


def test_mtp_after_media_with_its_own_towers(tmp_path):
    """With image_tower=on (and the audio tower) transformers claims MTP after media: generate(assistant_model=...)
    gets the prompt's padded patches / raw frames and mm_token_type_ids. After the audio prompt (M5) every round
    is the oracle's; after the image prompt (M4) its masks open the Unified image block by its own rule, as on the
    I0 cases (the prompt's last row 5.53 off): the known failure of its expectations file. Without the towers the
    two cases are not claimed."""
    select = r"^12b-assistant-mini/mtp/generate/M[45]/transformers/P$"
    on = TransformersBackend(dtype="float32", threads=1, image_tower="on")
    assert on.capabilities.mtp_media and not TransformersBackend().capabilities.mtp_media
    shipped = load_expectations(on.expectations_file)
    result = run_cases(on, [bundled_set("12b-assistant-mini")], PROFILES["fp32"], select=select, workdir=tmp_path,
                       expectations=shipped)
    by = {c.id.split("/")[3]: c for c in result.cases}
    assert by["M5"].status == "pass" and by["M5"].executed["drafter_calls"] == 27
    assert (by["M4"].status, by["M4"].check) == ("xfail", "max_abs") and result.exit_code == 0
    assert "max_abs 5.53" in by["M4"].message and "round 0 step 0: drafted 9" in by["M4"].message
    off = run_cases(TransformersBackend(dtype="float32", threads=1), [bundled_set("12b-assistant-mini")],
                    PROFILES["fp32"], select=select, workdir=tmp_path)
    assert {c.status for c in off.cases} == {"not-claimed"}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_assisted_generation_and_hidden_rows(dtype, tmp_path):
    """transformers' own generate(assistant_model=...) on the bundled MTP sets: every transformers/P generate
    case passes (drafts and acceptance round by round, the output plain greedy), and so do the hidden-state
    rows (its hidden_states[-1], the final norm's output) of a text subset."""
    backend = TransformersBackend(dtype=dtype)
    mtp = run_subset(backend, "fp32", tmp_path, select=r"/mtp/generate/M[0-3]/transformers/P$",
                     sets=("e2b-assistant-mini", "12b-assistant-mini"))
    assert len(mtp.cases) == 8 and not failures(mtp), failures(mtp)
    assert {c.executed["drafter"] for c in mtp.cases} == {"Gemma4AssistantForCausalLM",
                                                          "Gemma4UnifiedAssistantForCausalLM"}
    text = run_subset(backend, "fp32", tmp_path, select=r"^e2b-mini/(last/plain/A/T9/pos4|multi/A-T3\+B-T8\+C-T13)$",
                      sets=("e2b-mini",))
    hidden = [r for c in text.cases for r in c.rows if r["label"].endswith(" hidden")]
    assert not failures(text) and len(hidden) == 4 + 3 + 9  # the rows, their decode steps, all graded
    assert max(r["metrics"]["nmse"] for r in hidden) < 1e-10


ExactFloat64 = H.ExactFloat64Backend


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_plumbing_is_exact_with_float64_patches(attn, tmp_path):
    """With the float32 spots patched, the backend's caches, indices and micro-batches are exact."""
    result = run_subset(ExactFloat64(attn=attn), "exact-f64", tmp_path)
    assert not failures(result), failures(result)
    assert worst(result) < EXACT_BOUND


def test_sdpa_and_bfloat16(tmp_path):
    result = run_subset(TransformersBackend(attn="sdpa"), "fp32", tmp_path, sets=("e2b-mini",))
    assert not failures(result), failures(result)
    # bfloat16 on the dense preset without ill-conditioned rows (31b-mini: worst max_abs 0.65 < 8)
    bf16 = TransformersBackend(dtype="bfloat16")
    assert bf16.capabilities.default_profile == "bf16"
    result = run_subset(bf16, "bf16", tmp_path, select=SUBSET.replace("e2b-mini|", "31b-mini|"), sets=("31b-mini",))
    assert not failures(result), failures(result)
    assert all(c.executed["dtype"] == "bfloat16" for c in result.cases)


# ----------------------------------------------------------------------------------------------
# direct


@pytest.fixture(scope="module")
def f64(preset_dirs):
    backend = TransformersBackend(dtype="float64")
    backend.open(preset_dirs["e2b-mini"])  # PLE + KV sharing: logits_to_keep=1 prunes the shared layers
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def exact64(preset_dirs):
    backend = ExactFloat64()
    backend.open(preset_dirs["e2b-mini"])
    yield backend
    backend.close()


IDS = (2,) + tuple(range(40, 59))  # 20 tokens, more than two sliding windows (8)


def test_interior_row_is_the_full_forward_row(f64):
    full = f64.run(Request("full", tokens=IDS)).logits
    for pos in (0, 7, 13):
        res = f64.run(Request("last", tokens=IDS, entry="seq_id", seq_id=3, last_pos=pos))
        assert res.executed["logits_to_keep"] == [pos]
        assert res.executed["state_len_after_prefill"] == len(IDS)  # every token went into the cache
        assert res.logits.shape == (1, full.shape[1])
        assert max_abs(res.logits[0], full[pos]) < 1e-12
        assert max_abs(res.logits[0], full[pos + 1]) > 1.0  # not a neighbour
    last = f64.run(Request("last", tokens=IDS, last_pos=len(IDS) - 1))
    assert last.executed["logits_to_keep"] == 1  # generate's form; prunes rows before the shared layers
    assert max_abs(last.logits[0], full[-1]) < 1e-9


def test_no_output_micro_batch_writes_the_cache(exact64):
    """A forward with no output row still runs and writes the cache: the next piece's row is right.

    (Exact float64, since stock float64 rounds differently per chunking at its float32 spots: 1.5e-5.)
    """
    full = exact64.run(Request("full", tokens=IDS)).logits
    for ubatch in (None, 3, 4):
        res = exact64.run(Request("prefill", pieces=(Piece(IDS[:14], ()), Piece(IDS[14:], (5,))), ubatch=ubatch,
                              decode=(7, 9)))
        kept = [u["logits_to_keep"] for p in res.executed["pieces"] for u in p["ubatches"]]
        assert kept[:-1] == [[]] * (len(kept) - 1)  # every forward but the last has no output row
        assert res.executed["state_len_after_prefill"] == len(IDS)
        assert res.logits.shape == (1, full.shape[1])
        assert max_abs(res.logits[0], full[-1]) < EXACT_BOUND, ubatch
    # without the first piece's keys and values the row would be far off
    alone = exact64.run(Request("last", tokens=IDS[14:], last_pos=5)).logits[0]
    assert max_abs(alone, full[-1]) > 1.0


def test_transformers_logits_to_keep_zero_means_all_rows(f64):
    """Why the backend passes an empty index tensor, never 0, for a forward without output rows."""
    ids = torch.tensor([list(IDS)])
    with torch.inference_mode():
        assert f64.model(input_ids=ids, logits_to_keep=0).logits.shape[1] == len(IDS)
        assert f64.model(input_ids=ids, logits_to_keep=torch.tensor([], dtype=torch.long)).logits.shape[1] == 0
        assert f64.model(input_ids=ids, logits_to_keep=torch.tensor([3, 11])).logits.shape[1] == 2


def test_embeddings_convention_is_scaled(f64):
    table = f64.model.model.embed_tokens.weight.detach().numpy()
    raw = table[list(IDS)]
    scaled = raw * np.sqrt(f64.model.config.hidden_size)
    want = f64.run(Request("last", tokens=IDS, last_pos=9)).logits
    got = f64.run(Request("last", tokens=IDS, entry="embeddings", seq_id=1, last_pos=9, embeddings=scaled))
    assert f64.capabilities.embedding_convention == "scaled"
    assert max_abs(got.logits, want) < 1e-9
    wrong = f64.run(Request("last", tokens=IDS, entry="embeddings", seq_id=1, last_pos=9, embeddings=raw)).logits
    assert max_abs(wrong, want) > 1.0


def test_both_checkpoint_layouts(tmp_path):
    ids = IDS[:12]
    out = {}
    for layout in ("causal", "conditional"):
        path = write_checkpoint("26b-a4b-mini", 0, tmp_path / layout, layout=layout)
        backend = TransformersBackend()
        backend.open(path)
        res = backend.run(Request("full", tokens=ids, decode=(5,)))
        assert res.executed["layout"] == layout
        out[layout] = (res.logits, res.decode_logits)
        backend.close()
    # The same Gemma4ForCausalLM with the same weights (the conditional layout's renamed), but not bit for
    # bit: the weights are memory-mapped from another file offset, and torch's float32 kernels round
    # differently at another alignment (measured: copying one model's weights into the other gives its
    # logits exactly). So float32 rounding: eps 1.2e-7 relative to the logits' scale (|logit| <= 29 here),
    # times 64 for sums of 64 terms (the hidden size; n eps bounds a length-n sum) = 2.2e-4. Measured
    # 1.2e-5 to 3.5e-5 with torch's AVX-512, AVX2 and default CPU code; a wrong or missing tensor, a dropped
    # softcap or a shifted row moves the logits by O(1).
    for a, b in zip(out["causal"], out["conditional"], strict=True):
        bound = 64 * np.finfo(np.float32).eps * float(np.abs(a).max())
        assert max_abs(a, b) < bound
    assert out["causal"][0].dtype == np.float32


def test_multi_sequences_keep_their_own_caches(f64):
    a, b = IDS[:9], IDS[5:17]
    res = f64.run(Request("multi", sequences=(a, b), seq_ids=(4, 9), decode=((11, 12), (13,))))
    alone_a = f64.run(Request("last", tokens=a, last_pos=len(a) - 1, decode=(11, 12)))
    alone_b = f64.run(Request("last", tokens=b, last_pos=len(b) - 1, decode=(13,)))
    assert max_abs(res.logits, np.concatenate([alone_a.logits, alone_b.logits])) < 1e-12
    assert max_abs(res.decode_logits[0], alone_a.decode_logits) < 1e-12
    assert max_abs(res.decode_logits[1], alone_b.decode_logits) < 1e-12
    assert res.executed["state_len_after_prefill"] == [len(a), len(b)]


# ----------------------------------------------------------------------------------------------
# identity, options and errors


def test_identity_and_capabilities():
    b = TransformersBackend()
    assert isinstance(b, Backend)
    assert (b.name, b.dtype, b.attn, str(b.device)) == ("transformers-float32-eager", "float32", "eager", "cpu")
    claimed = b.capabilities.to_dict()
    assert claimed.pop("embedding_convention") == "scaled"
    assert claimed.pop("default_profile") == "fp32"
    assert claimed.pop("image_tower") is False  # on request only: Gemma 4 Unified's own embedder (image_tower=on)
    assert claimed.pop("mtp") is False  # MTP: its own assisted generation only (mode generate)
    # nor after media (it sends the prompt's ids only) nor batched (assisted generate takes one sequence)
    assert claimed.pop("mtp_media") is False and claimed.pop("mtp_batch") is False
    assert claimed.pop("mtp_conventions") == "transformers/P"
    assert claimed.pop("weight_formats") == "safetensors"  # transformers does not read MLX's quantised format
    assert claimed.pop("activation_conventions") == "none"
    assert claimed.pop("top_logprobs") is False  # whole logits rows
    assert all(v is True for v in claimed.values()), claimed
    assert TransformersBackend(dtype="float64").capabilities.default_profile == "fp32"
    assert TransformersBackend(dtype="float64", attn="sdpa").name == "transformers-float64-sdpa"
    assert TransformersBackend(experts="batched_mm").name == "transformers-float32-eager-experts-batched_mm"
    # float32 / float64: the Gemma 4 Unified vision-mask rule (transformers 5.24's default forward), only that
    for dtype in ("float32", "float64"):
        for attn in ("eager", "sdpa"):
            t = TransformersBackend(dtype=dtype, attn=attn, device="cpu")
            assert t.expectations_file == EXPECTATIONS_DIR / f"transformers-{dtype}-{attn}.json"
            images, videos = load_expectations(t.expectations_file).entries  # 12b-mini's images, 12b-mini-video
            # (12b-mini's images also match 12b-assistant-mini's: the same model, the same I0 base)
            for entry, prefix in ((images, "^12b\\-(?:assistant\\-)?mini/"), (videos, "^12b\\-mini\\-video/")):
                assert entry.action == "known-failure" and entry.match.startswith(prefix) and "46711" in entry.issue
            assert TransformersBackend(dtype=dtype, attn=attn, device="cpu",
                                       image_tower="on").expectations_file == t.expectations_file
    for attn in ("eager", "sdpa"):  # bf16 known failures, measured on CPU
        bf16 = TransformersBackend(dtype="bfloat16", attn=attn, device="cpu")
        assert bf16.expectations_file == EXPECTATIONS_DIR / f"transformers-bfloat16-{attn}-cpu.json"
        exp = load_expectations(bf16.expectations_file)
        assert exp.backend == bf16.name and exp.entries
        assert all(e.action == "known-failure" and e.reason for e in exp.entries)
    loaded = registry.load_backend("transformers", dtype="float64", attn="sdpa")
    assert isinstance(loaded, TransformersBackend) and loaded.name == "transformers-float64-sdpa"


def test_bad_options():
    cases = [
        ({"dtype": "float16"},
         "transformers backend: dtype must be one of float32, float64, bfloat16, got 'float16'"),
        ({"attn": "flash_attention_2"},
         "transformers backend: attn must be one of eager, sdpa, got 'flash_attention_2'"),
        ({"device": "tpu"},
         "transformers backend: device must be one of auto, cpu, cuda (or cuda:N), got 'tpu'"),
        ({"experts": "fast"},
         "transformers backend: experts must be one of auto, eager, grouped_mm, batched_mm, got 'fast'"),
        ({"threads": 0}, "transformers backend: threads must be None or an integer >= 1, got 0"),
        ({"audio_tower": True}, "transformers backend: audio_tower must be one of auto, on, off, got True"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError) as info:
            TransformersBackend(**options)
        assert str(info.value) == message
        with pytest.raises(BackendError) as info:
            registry.load_backend("transformers", **options)
        assert str(info.value) == f"backend 'transformers': the class raised ValueError: {message}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_unavailable():
    assert str(TransformersBackend(device="auto").device) == "cpu"
    for device in ("cuda", "cuda:1"):
        with pytest.raises(BackendError) as info:
            TransformersBackend(device=device)
        assert str(info.value) == (
            f"transformers backend: device {device!r} was requested but CUDA is not available "
            f"(torch {torch.__version__}: torch.cuda.is_available() is False); use device='cpu' or device='auto'")


def test_open_errors(tmp_path):
    b = TransformersBackend()
    with pytest.raises(RuntimeError, match=r"run\(\) called before open\(\)"):
        b.run(Request("full", tokens=(2, 3)))
    with pytest.raises(BackendError, match=f"^{tmp_path}: cannot read config.json: "):
        b.open(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(BackendError, match=f"^{tmp_path}: config.json is not a Gemma 4 config "
                                           r"\(model_type 'llama'\)$"):
        b.open(tmp_path)
    # a conditional-layout checkpoint (tensors model.language_model.*) whose config.json was replaced by
    # the causal text config: Gemma4ForCausalLM finds none of its weights under its own names
    bad = write_checkpoint("e2b-mini", 0, tmp_path / "relabelled", layout="conditional")
    text = json.loads((bad / "config.json").read_text())["text_config"]
    (bad / "config.json").write_text(json.dumps(text))
    with pytest.raises(BackendError, match=rf"^transformers cannot load {bad} \(causal layout\): weights "
                                           r"missing \['model\.embed_tokens\.weight', "):
        b.open(bad)
    # no weights at all
    (bad / "model.safetensors").unlink()
    with pytest.raises(BackendError, match=rf"^transformers 5\.\S+ cannot load {bad} \(causal layout\): OSError: "):
        load_gemma4_causal_lm(bad)


def test_tokens_and_rows_are_checked(f64):
    with pytest.raises(ValueError, match="last_pos 5 is outside the 3 tokens of the call"):
        f64.run(Request("last", tokens=(2, 3, 4), last_pos=5))
    with pytest.raises(ValueError, match=r"piece 0 rows \[2, 1\] must be increasing within \[0, 3\)"):
        f64.run(Request("prefill", pieces=(Piece((2, 3, 4), (2, 1)),)))
    with pytest.raises(ValueError, match=r"embeddings have shape \(2, 64\), expected \(3, 64\)"):
        f64.run(Request("last", tokens=(2, 3, 4), entry="embeddings", seq_id=0, last_pos=2,
                        embeddings=np.zeros((2, 64))))
    assert tup(f64.run(Request("prefill", pieces=(Piece((2, 3), ()),))).logits.shape) == (0, 512)


# ----------------------------------------------------------------------------------------------
# image prompts
#
# Vision checkpoints load as Gemma4ForConditionalGeneration; an image request goes in as inputs_embeds
# (soft tokens unscaled at image rows), per_layer_inputs looked up at pad_token_id in the image blocks,
# and mm_token_type_ids from the sequence's start, from which Gemma4Model.forward builds the masks
# (create_masks_for_vision_model on use_bidirectional_attention == "vision" checkpoints). Measured
# against the oracle (two images, 12 and 4 soft tokens, T=37; every row of image_requests): exact
# float64 (tests/hf_reference.py patches) worst 1.0e-12 eager / 1.6e-12 sdpa (e2b-vision-mini),
# 2.4e-13 / 2.2e-13 (31b-vision-mini); float32 as shipped 3.7e-4 / 2.2e-4 (e2b-vision-mini),
# 8.8e-5 / 7.4e-5 (31b-vision-mini), every row passing the fp32 profile.

VISION_PRESETS = ("e2b-vision-mini", "31b-vision-mini")
DECODE = (30, 31, 32)


@pytest.fixture(scope="module")
def image_prompts(preset_dirs):
    """{preset: (prompt, oracle logits of the prompt followed by DECODE [T + 3, V])}."""
    from helpers import image_prompt

    from conformance.backends.refimpl_backend import RefimplBackend

    out = {}
    for preset in VISION_PRESETS:
        p = image_prompt(preset_dirs[preset], grids=((9, 12), (6, 6)))
        ref = RefimplBackend()
        ref.open(preset_dirs[preset])
        T = len(p["ids"])
        dec = ref.run(Request("last", tokens=tup(p["ids"]), entry="embeddings", seq_id=0, last_pos=T - 1,
                              embeddings=p["embeddings"], images=tuple(p["images"]), decode=DECODE)).decode_logits
        ref.close()
        out[preset] = (p, np.concatenate([p["logits"], dec]))
    return out


def image_requests(p):
    """(name, request, oracle positions of its rows: logits then decode) over one image prompt: last rows
    inside a block, at its last token, at the eoi right after it, the next text token and the last (with
    decode); one prefill with output rows; chunks split after the first eoi and inside the text after
    the second image, with decode."""
    ids, E, images = tup(p["ids"]), p["embeddings"], tuple(tuple(b) for b in p["images"])
    T = len(ids)
    (s0, n0), (s1, n1) = images
    dec = list(range(T, T + len(DECODE)))
    out = []
    for pos in (s0 + 3, s0 + n0 - 1, s0 + n0, s0 + n0 + 1, s1, T - 1):
        decode = DECODE if pos == T - 1 else ()
        out.append((f"last/pos{pos}", Request("last", tokens=ids, entry="embeddings", seq_id=0, last_pos=pos,
                                              embeddings=E, images=images, decode=decode),
                    [pos] + (dec if decode else [])))
    rows = (2, s0, s0 + 5, s0 + n0, s1 + 1, T - 1)
    out.append(("prefill/rows", Request("prefill", pieces=(Piece(ids, rows, embeddings=E),), images=images,
                                        decode=DECODE), list(rows) + dec))
    cut, cut2 = s0 + n0 + 1, s1 + n1 + 2
    pieces = (Piece(ids[:cut], (s0 + 1, cut - 1), embeddings=E[:cut]),
              Piece(ids[cut:cut2], (0, s1 - cut, cut2 - cut - 1), embeddings=E[cut:cut2]),
              Piece(ids[cut2:], (T - cut2 - 1,), embeddings=E[cut2:]))
    out.append(("prefill/chunks", Request("prefill", pieces=pieces, images=images, decode=DECODE),
                [s0 + 1, cut - 1, cut, s1, cut2 - 1, T - 1] + dec))
    return out


def all_rows(res):
    return res.logits if res.decode_logits is None else np.concatenate([res.logits, res.decode_logits])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("preset", VISION_PRESETS)
def test_image_prompts_are_exact_with_float64_patches(preset, attn, preset_dirs, image_prompts):
    p, oracle = image_prompts[preset]
    backend = ExactFloat64(attn=attn)
    backend.open(preset_dirs[preset])
    bidirectional = preset == "31b-vision-mini"
    worst = 0.0
    for name, request, positions in image_requests(p):
        res = backend.run(request)
        diff = max_abs(all_rows(res), oracle[positions])
        worst = max(worst, diff)
        assert diff < EXACT_BOUND, (name, diff)
        ex = res.executed
        assert ex["model"] == "Gemma4ForConditionalGeneration" and ex["layout"] == "conditional"
        assert ex["images"] == [list(b) for b in request.images]
        assert ex["per_layer_inputs"] == ("get_per_layer_inputs(token ids, pad_token_id 0 at image positions)"
                                          if preset == "e2b-vision-mini" else None)
        assert ex["image_mask"].startswith("mm_token_type_ids" if bidirectional else "causal")
        forwards = [u for piece in ex["pieces"] for u in piece["ubatches"]] if "pieces" in ex else [ex]
        function = "create_masks_for_vision_model" if bidirectional else "create_masks_for_generate"
        assert all(f["mask_function"] == function for f in forwards), forwards
        if name == "prefill/chunks":  # the types from the sequence's start: every token the cache holds
            assert [f["mm_token_type_ids"] for f in forwards] == [p["images"][0][0] + p["images"][0][1] + 1,
                                                                   p["images"][1][0] + p["images"][1][1] + 2,
                                                                   len(p["ids"])]
    print(f"\n{preset} {attn}: worst |transformers (float64 patched) - oracle| = {worst:.2e}")
    # a text request on the image-text model: input_ids through Gemma4ForConditionalGeneration
    text = tup(p["ids"][:6])
    from refimpl import Gemma4

    assert max_abs(backend.run(Request("full", tokens=text)).logits, Gemma4(preset_dirs[preset]).forward(
        np.asarray(text))) < EXACT_BOUND
    backend.close()


def grade_fp32(got: np.ndarray, positions: list[int], oracle: np.ndarray):
    """Grade rows with the harness's own grader and the fp32 profile (base: the oracle rows)."""
    from types import SimpleNamespace

    from conformance.check.grading import grade_case
    from conformance.sets.case import RowSpec

    specs = [RowSpec(label=f"row {i}", base="b", position=pos) for i, pos in enumerate(positions)]
    case = SimpleNamespace(generation=None, moe_min_margin=None)
    return grade_case(case, [("rows", specs)], [got], {"b": oracle}, PROFILES["fp32"])


@pytest.mark.parametrize("preset", VISION_PRESETS)
def test_image_prompts_pass_fp32_as_shipped(preset, preset_dirs, image_prompts):
    p, oracle = image_prompts[preset]
    for attn in ("eager", "sdpa"):
        backend = TransformersBackend(attn=attn)
        backend.open(preset_dirs[preset])
        worst = 0.0
        for name, request, positions in image_requests(p):
            res = backend.run(request)
            assert res.logits.dtype == np.float32
            grade = grade_fp32(all_rows(res), positions, oracle)
            bad = [f"{r.label}: {r.check} {r.message}" for r in grade.rows if r.status != "pass"]
            assert not bad, (name, bad)
            worst = max(worst, max_abs(all_rows(res), oracle[positions]))
        print(f"\n{preset} float32 {attn}: worst |transformers - oracle| = {worst:.2e}")
        assert worst < F64_BOUND
        backend.close()


def test_each_image_rule_matters(preset_dirs, image_prompts, monkeypatch):
    """The mask transformers builds from mm_token_type_ids, the types from the sequence's start and the
    pad row of the per-layer inputs each matter: without one, rows are far off."""
    import transformers.models.gemma4.modeling_gemma4 as mg

    from conformance.backends.transformers.backend import SequenceState

    # 31b-vision-mini: transformers' own create_masks_for_vision_model builds the sliding mask
    p, oracle = image_prompts["31b-vision-mini"]
    backend = ExactFloat64()
    backend.open(preset_dirs["31b-vision-mini"])
    requests = {name: (r, pos) for name, r, pos in image_requests(p)}
    calls = []
    original = mg.create_masks_for_vision_model
    monkeypatch.setattr(mg, "create_masks_for_vision_model",
                        lambda **kw: calls.append(kw["block_sequence_ids"].tolist()) or original(**kw))
    request, positions = requests["prefill/chunks"]
    assert max_abs(all_rows(backend.run(request)), oracle[positions]) < EXACT_BOUND
    (s0, n0), (s1, n1) = p["images"]
    assert [len(c[0]) for c in calls] == [s0 + n0 + 1, s1 + n1 + 2, len(p["ids"])]  # decode steps: no call
    assert calls[-1][0][s0:s0 + n0] == [0] * n0 and calls[-1][0][s1:s1 + n1] == [1] * n1
    monkeypatch.setattr(mg, "create_masks_for_vision_model", original)

    wrong = {}
    # no mm_token_type_ids: transformers is causal over the images
    forward = backend.model.forward
    monkeypatch.setattr(backend.model, "forward", lambda **kw: forward(**{**kw, "mm_token_type_ids": None}))
    wrong["no mm_token_type_ids"] = max_abs(all_rows(backend.run(request)), oracle[positions])
    monkeypatch.undo()

    # only the current forward's types: the blocks of a later piece are read at the wrong positions
    class Forgetful(SequenceState):
        token_types = property(lambda self: [], lambda self, value: None)

    monkeypatch.setattr(backend, "_new_state", lambda: Forgetful(torch_cache(backend)))
    wrong["types of the current piece only"] = max_abs(all_rows(backend.run(request)), oracle[positions])
    monkeypatch.undo()
    backend.close()

    # e2b-vision-mini: the per-layer inputs' token part from the pad row
    p, oracle = image_prompts["e2b-vision-mini"]
    backend = ExactFloat64()
    backend.open(preset_dirs["e2b-vision-mini"])
    request, positions = {name: (r, pos) for name, r, pos in image_requests(p)}["prefill/rows"]
    monkeypatch.setattr(type(backend), "pad_token_id", property(lambda self: self.image_token_id))
    wrong["PLE row of the image token"] = max_abs(all_rows(backend.run(request)), oracle[positions])
    monkeypatch.undo()
    backend.close()
    print("\nwrong variants:", {k: f"{v:.2e}" for k, v in wrong.items()})
    assert all(v > 0.1 for v in wrong.values()), wrong


def torch_cache(backend):
    from transformers import DynamicCache

    return DynamicCache(config=backend.model.config)


def test_image_prompt_errors(preset_dirs, image_prompts, f64):
    p, _ = image_prompts["e2b-vision-mini"]
    ids, E = tup(p["ids"]), p["embeddings"]
    (s0, n0), _ = p["images"]
    request = Request("last", tokens=ids, entry="embeddings", seq_id=0, last_pos=len(ids) - 1, embeddings=E,
                      images=((s0 - 1, n0),))
    backend = TransformersBackend(dtype="float64")
    backend.open(preset_dirs["e2b-vision-mini"])
    with pytest.raises(ValueError, match=rf"^transformers backend: the image block \({s0 - 1}, {n0}\) holds tokens "
                                         rf"other than the image token {backend.image_token_id} \(a video "
                                         rf"frame's: the video token {backend.video_token_id}\)$"):
        backend.run(request)
    backend.close()
    # f64 is open on the text-only e2b-mini (the same text model, no vision tower)
    assert f64.capabilities.image_prompts
    with pytest.raises(ValueError, match=r"has no vision_config \(a text-only checkpoint\); it cannot serve image "
                                         r"prompts$"):
        f64.run(Request("last", tokens=ids, entry="embeddings", seq_id=0, last_pos=len(ids) - 1, embeddings=E,
                        images=tuple(p["images"])))


# ----------------------------------------------------------------------------------------------
# audio prompts
#
# Audio checkpoints (e2b-audio-mini) load as Gemma4ForConditionalGeneration. An audio request goes in as
# inputs_embeds whose audio rows are replaced by transformers' own audio tower (get_audio_features on the
# request's audio_inputs, pooler_output[attention_mask]), per_layer_inputs at pad_token_id in the audio
# blocks and mm_token_type_ids 3 there (never a vision block). Measured against the oracle (two clips,
# 11 and 7 soft tokens, one with masked padding frames, T=37; every row of audio_requests):
# exact float64 (hf_reference + test_audio_tower patches) worst 5.7e-12 eager / 5.8e-12 sdpa (the audio
# tower always eager: transformers' Gemma4AudioModel takes no other), the tower's soft tokens within 4.0e-14
# of the oracle's; float32 as shipped worst 1.2e-3 eager / 1.3e-3 sdpa (soft tokens 5.9e-6), every row
# passing fp32.

AUDIO_PRESET = "e2b-audio-mini"


@pytest.fixture(scope="module")
def audio_prompts(preset_dirs):
    """(prompt, oracle logits of the prompt followed by DECODE [T + 3, V]) on e2b-audio-mini."""
    from helpers import audio_prompt

    from conformance.backends.refimpl_backend import RefimplBackend

    p = audio_prompt(preset_dirs[AUDIO_PRESET])
    ref = RefimplBackend()
    ref.open(preset_dirs[AUDIO_PRESET])
    T = len(p["ids"])
    dec = ref.run(Request("last", tokens=tup(p["ids"]), entry="embeddings", seq_id=0, last_pos=T - 1,
                          embeddings=p["embeddings"], audio=tuple(p["audio"]), audio_inputs=p["audio_inputs"],
                          decode=DECODE)).decode_logits
    ref.close()
    return p, np.concatenate([p["logits"], dec])


def audio_requests(p, embeddings=None):
    """(name, request, oracle positions of its rows) over the audio prompt: last rows inside a clip, at its
    last token, at the eoa, the next text token and the last (with decode); one prefill with output rows;
    chunks split after the first eoa and inside the text after the second clip, with decode."""
    ids, spans, clips = tup(p["ids"]), tuple(tuple(b) for b in p["audio"]), p["audio_inputs"]
    E = p["embeddings"] if embeddings is None else embeddings
    T = len(ids)
    (s0, n0), (s1, n1) = spans
    dec = list(range(T, T + len(DECODE)))
    out = []
    for pos in (s0 + 3, s0 + n0 - 1, s0 + n0, s0 + n0 + 1, s1, T - 1):
        decode = DECODE if pos == T - 1 else ()
        out.append((f"last/pos{pos}", Request("last", tokens=ids, entry="embeddings", seq_id=0, last_pos=pos,
                                              embeddings=E, audio=spans, audio_inputs=clips, decode=decode),
                    [pos] + (dec if decode else [])))
    rows = (2, s0, s0 + 5, s0 + n0, s1 + 1, T - 1)
    out.append(("prefill/rows", Request("prefill", pieces=(Piece(ids, rows, embeddings=E),), audio=spans,
                                        audio_inputs=clips, decode=DECODE), list(rows) + dec))
    cut, cut2 = s0 + n0 + 1, s1 + n1 + 2
    pieces = (Piece(ids[:cut], (s0 + 1, cut - 1), embeddings=E[:cut]),
              Piece(ids[cut:cut2], (0, s1 - cut, cut2 - cut - 1), embeddings=E[cut:cut2]),
              Piece(ids[cut2:], (T - cut2 - 1,), embeddings=E[cut2:]))
    out.append(("prefill/chunks", Request("prefill", pieces=pieces, audio=spans, audio_inputs=clips, decode=DECODE),
                [s0 + 1, cut - 1, cut, s1, cut2 - 1, T - 1] + dec))
    return out


class ExactAudioFloat64(ExactFloat64):
    """ExactFloat64 plus tests/oracle/towers/test_audio_tower.py's float64 audio patches and buffers, with transformers'
    audio tower on (unpatched, transformers 5.24's audio tower does not run in float64)."""

    def __init__(self, **options):
        super().__init__(audio_tower="on", **options)

    def open(self, model_dir):
        import transformers.models.gemma4.modeling_gemma4 as mg
        from hf_towers import recompute_audio_buffers

        super().open(model_dir)
        recompute_audio_buffers(torch, mg, self.model)

    def run(self, request):
        import transformers.models.gemma4.modeling_gemma4 as mg
        from hf_towers import audio_float64_exact

        with audio_float64_exact(torch, mg, H):
            return TransformersBackend.run(self, request)


def audio_forwards(ex) -> list[dict]:
    """The per-forward notes of an executed record (the last forward, or every prefill micro-batch)."""
    return [u for piece in ex["pieces"] for u in piece["ubatches"]] if "pieces" in ex else [ex]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_audio_prompts_are_exact_with_float64_patches(attn, preset_dirs, audio_prompts):
    p, oracle = audio_prompts
    backend = ExactAudioFloat64(attn=attn)
    assert backend.capabilities.audio_prompts and backend.capabilities.audio_tower
    backend.open(preset_dirs[AUDIO_PRESET])
    assert (backend.vision, backend.audio) == (False, True)
    worst = tower = 0.0
    for name, request, positions in audio_requests(p):
        res = backend.run(request)
        diff = max_abs(all_rows(res), oracle[positions])
        worst = max(worst, diff)
        assert diff < EXACT_BOUND, (name, diff)
        ex = res.executed
        assert ex["model"] == "Gemma4ForConditionalGeneration" and ex["layout"] == "conditional"
        assert ex["audio"] == [list(b) for b in request.audio]
        assert ex["per_layer_inputs"] == "get_per_layer_inputs(token ids, pad_token_id 0 at audio and image positions)"
        assert ex["audio_tower"].startswith("transformers 5.") and "get_audio_features" in ex["audio_tower"]
        forwards = audio_forwards(ex)
        assert all(f["mask_function"] == "create_masks_for_generate" for f in forwards), forwards
        with_audio = [f for f in forwards if "audio_soft_tokens" in f]
        assert len(with_audio) == (1 if name.startswith("last") or name == "prefill/rows" else 2)
        assert all(f["audio_soft_tokens"].startswith("transformers audio tower") for f in with_audio)
        tower = max([tower] + [f["audio_rows_max_abs"] for f in with_audio])
        if name == "prefill/chunks":  # the types from the sequence's start; the middle piece has no clip
            assert [f["mm_token_type_ids"] for f in forwards] == [p["audio"][0][0] + p["audio"][0][1] + 1,
                                                                   p["audio"][1][0] + p["audio"][1][1] + 2,
                                                                   len(p["ids"])]
    print(f"\n{AUDIO_PRESET} {attn}: worst |transformers (float64 patched) - oracle| = {worst:.2e}; "
          f"soft tokens of transformers' audio tower vs the oracle's: {tower:.2e}")
    assert tower < 1e-13
    backend.close()


def test_audio_prompts_pass_fp32_as_shipped(preset_dirs, audio_prompts):
    p, oracle = audio_prompts
    for attn in ("eager", "sdpa"):
        backend = TransformersBackend(attn=attn)
        backend.open(preset_dirs[AUDIO_PRESET])
        worst = tower = 0.0
        for name, request, positions in audio_requests(p):
            res = backend.run(request)
            assert res.logits.dtype == np.float32
            grade = grade_fp32(all_rows(res), positions, oracle)
            bad = [f"{r.label}: {r.check} {r.message}" for r in grade.rows if r.status != "pass"]
            assert not bad, (name, bad)
            worst = max(worst, max_abs(all_rows(res), oracle[positions]))
            tower = max([tower] + [f["audio_rows_max_abs"] for f in audio_forwards(res.executed)
                                   if "audio_rows_max_abs" in f])
        print(f"\n{AUDIO_PRESET} float32 {attn}: worst |transformers - oracle| = {worst:.2e}; soft tokens of "
              f"transformers' audio tower vs the oracle's: {tower:.2e}")
        assert worst < 5e-3 and tower < 1e-4
        backend.close()


def test_audio_soft_tokens_come_from_transformers_tower(preset_dirs, audio_prompts, monkeypatch):
    """The backend's soft tokens are its own: with the request's audio rows zeroed the tower still gives the
    oracle's logits, while audio_tower='off' (the rows as given) is then far off; and the pad row of the
    per-layer inputs matters."""
    p, oracle = audio_prompts
    zeroed = p["embeddings"].copy()
    for s, n in p["audio"]:
        zeroed[s:s + n] = 0.0
    backend = ExactAudioFloat64()
    backend.open(preset_dirs[AUDIO_PRESET])
    requests = {name: (r, pos) for name, r, pos in audio_requests(p, embeddings=zeroed)}
    request, positions = requests["prefill/chunks"]
    res = backend.run(request)
    assert max_abs(all_rows(res), oracle[positions]) < EXACT_BOUND
    assert min(f["audio_rows_max_abs"] for f in audio_forwards(res.executed) if "audio_rows_max_abs" in f) > 0.1
    wrong = {}
    monkeypatch.setattr(type(backend), "pad_token_id", property(lambda self: self.audio_token_id))
    wrong["PLE row of the audio token"] = max_abs(all_rows(backend.run(request)), oracle[positions])
    monkeypatch.undo()
    backend.close()

    given = ExactFloat64(audio_tower="off")
    assert given.capabilities.audio_prompts and not given.capabilities.audio_tower
    given.open(preset_dirs[AUDIO_PRESET])
    res = given.run(request)
    assert all(f["audio_soft_tokens"] == "given (the request's embeddings)"
               for f in audio_forwards(res.executed) if "audio_soft_tokens" in f)
    assert res.executed["audio_tower"] == "none: the request's soft tokens are used as given"
    wrong["audio_tower off, zeroed rows"] = max_abs(all_rows(res), oracle[positions])
    # with the right rows, the given soft tokens are served exactly too
    request, positions = {name: (r, pos) for name, r, pos in audio_requests(p)}["prefill/chunks"]
    assert max_abs(all_rows(given.run(request)), oracle[positions]) < EXACT_BOUND
    given.close()
    print("\nwrong variants:", {k: f"{v:.2e}" for k, v in wrong.items()})
    assert all(v > 0.1 for v in wrong.values()), wrong


def test_audio_prompt_errors(preset_dirs, audio_prompts, f64):
    from dataclasses import replace

    from conformance.protocol import AudioInput

    p, _ = audio_prompts
    ids, E = tup(p["ids"]), p["embeddings"]
    (s0, n0), (s1, n1) = p["audio"]
    request = Request("last", tokens=ids, entry="embeddings", seq_id=0, last_pos=len(ids) - 1, embeddings=E,
                      audio=tuple(p["audio"]), audio_inputs=p["audio_inputs"])
    # float64 as shipped: transformers' audio tower does not run, so by default the given rows are used
    assert f64.capabilities.audio_prompts and not f64.capabilities.audio_tower
    assert TransformersBackend().capabilities.audio_tower
    assert TransformersBackend(dtype="float64", audio_tower="on").name == "transformers-float64-eager-audio-tower-on"
    backend = TransformersBackend(dtype="float64", audio_tower="on")
    backend.open(preset_dirs[AUDIO_PRESET])
    with pytest.raises(RuntimeError, match=r"^transformers backend: transformers 5\.\S+'s audio tower does not run in "
                                           r"float64 \(.*\); use audio_tower='off' \(the request's soft tokens\) or "
                                           r"float32$"):
        backend.run(request)
    backend.close()
    backend = TransformersBackend()
    backend.open(preset_dirs[AUDIO_PRESET])
    with pytest.raises(ValueError, match=rf"^transformers backend: the audio block \({s0 - 1}, {n0}\) holds tokens "
                                         rf"other than the audio token {backend.audio_token_id}$"):
        backend.run(replace(request, audio=((s0 - 1, n0), (s1, n1))))
    clip = p["audio_inputs"][1]
    short = AudioInput(clip.features, clip.mask & (np.arange(len(clip.mask)) < 20))  # 5 soft tokens, not 7
    with pytest.raises(ValueError, match=rf"^transformers backend: the audio block \({s1}, {n1}\) has {n1} tokens but "
                                         r"transformers' audio tower gives 5 soft tokens for its clip$"):
        backend.run(replace(request, audio_inputs=(p["audio_inputs"][0], short)))
    with pytest.raises(ValueError, match=r"2 audio blocks but 1 audio_inputs"):
        backend.run(replace(request, audio_inputs=p["audio_inputs"][:1]))
    # an image request on the audio-text checkpoint
    with pytest.raises(ValueError, match=r"has no vision_config \(an audio-text checkpoint\); it cannot serve image "
                                         r"prompts$"):
        backend.run(replace(request, audio=(), audio_inputs=(), images=tuple(p["audio"])))
    backend.close()
    # f64 is open on the text-only e2b-mini (the same text model, no towers)
    with pytest.raises(ValueError, match=r"has no audio_config \(a text-only checkpoint\); it cannot serve audio "
                                         r"prompts$"):
        f64.run(request)
    # an image-text checkpoint has no audio tower either
    vision = TransformersBackend()
    vision.open(preset_dirs["e2b-vision-mini"])
    with pytest.raises(ValueError, match=r"has no audio_config \(an image-text checkpoint\); it cannot serve audio "
                                         r"prompts$"):
        vision.run(request)
    vision.close()
