"""Real-size synthetic checkpoints (``refimpl synth --preset e2b|e4b|26b-a4b|31b [--layers N]``) and the
streaming paths they rely on: the published shapes against the numbers of gemma4-text-spec.md
(sections 1 and 5, typed in here from the spec, not from the code), every cut to fewer layers is a
valid config with the same per-layer shapes, the streamed safetensors writer writes the same bytes as
the in-memory one, a streamed checkpoint is independent of its chunk size, and the forward pass reads
embedding tables by rows and the head in vocabulary chunks only.
"""

from __future__ import annotations

import itertools
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import namedtuple

import numpy as np
import pytest

from refimpl import safetensors_stream, synth
from refimpl.cli import main as cli_main
from refimpl.config import FULL, SLIDING, parse_config
from refimpl.model import HEAD_CHUNK, Gemma4
from refimpl.presets import PUBLISHED_COMMON
from refimpl.safetensors_io import TensorStore, write_safetensors
from refimpl.safetensors_stream import AHEAD_BYTES, AHEAD_QUEUE, ahead_bytes, write_safetensors_streamed
from refimpl.synth import PUBLISHED, published_config, write_published_checkpoint
from refimpl.weights import expected_tensors

# gemma4-text-spec.md section 1 (table) and section 5 ("Concrete attention shapes", PLE and expert tensors)
Spec = namedtuple("Spec", "H L full_layers sliding_qkvo full_qkvo ffn ple moe shared")
SPEC = {
    "e2b": Spec(1536, 35, [4, 9, 14, 19, 24, 29, 34], ((2048, 1536), (256, 1536), (256, 1536), (1536, 2048)),
                ((4096, 1536), (512, 1536), (512, 1536), (1536, 4096)), {**{i: 6144 for i in range(15)},
                                                                        **{i: 12288 for i in range(15, 35)}},
                (262144, 8960), None, 20),
    "e4b": Spec(2560, 42, list(range(5, 42, 6)), ((2048, 2560), (512, 2560), (512, 2560), (2560, 2048)),
                ((4096, 2560), (1024, 2560), (1024, 2560), (2560, 4096)), {i: 10240 for i in range(42)},
                (262144, 10752), None, 18),
    "26b-a4b": Spec(2816, 30, [5, 11, 17, 23, 29], ((4096, 2816), (2048, 2816), (2048, 2816), (2816, 4096)),
                    ((8192, 2816), (1024, 2816), None, (2816, 8192)), {i: 2112 for i in range(30)}, None,
                    ((128, 1408, 2816), (128, 2816, 704)), 0),
    "31b": Spec(5376, 60, list(range(5, 60, 6)), ((8192, 5376), (4096, 5376), (4096, 5376), (5376, 8192)),
                ((16384, 5376), (2048, 5376), None, (5376, 16384)), {i: 21504 for i in range(60)}, None, None, 0),
}


def _shapes(variant: str, layers: int | None = None) -> tuple[object, dict]:
    cfg = parse_config(published_config(variant, 106, layers))
    return cfg, expected_tensors(cfg)


@pytest.mark.parametrize("variant", list(SPEC))
def test_published_shapes_match_the_spec(variant):
    spec = SPEC[variant]
    cfg, t = _shapes(variant)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (spec.H, spec.L, 262144)
    assert [layer.index for layer in cfg.layers if not layer.is_sliding] == spec.full_layers
    assert t["embed_tokens.weight"] == (262144, spec.H)
    for layer in cfg.layers:
        p = f"layers.{layer.index}.self_attn."
        q, k, v, o = spec.full_qkvo if not layer.is_sliding else spec.sliding_qkvo
        assert t[p + "q_proj.weight"] == q and t[p + "o_proj.weight"] == o
        if layer.owns_kv:
            assert t[p + "k_proj.weight"] == k
            assert t.get(p + "v_proj.weight") == v  # None: K=V full layers have no v_proj
        assert t[f"layers.{layer.index}.mlp.gate_proj.weight"] == (spec.ffn[layer.index], spec.H)
    assert t.get("embed_tokens_per_layer.weight") == spec.ple
    if spec.moe:
        assert (t["layers.0.experts.gate_up_proj"], t["layers.0.experts.down_proj"]) == spec.moe
    assert cfg.num_kv_shared_layers == spec.shared


def test_e2b_kv_sources_are_the_published_ones():
    """E2B: shared sliding layers read layer 13, shared full layers read layer 14 (spec 4.6)."""
    cfg, _ = _shapes("e2b")
    for layer in cfg.layers[15:]:
        assert layer.kv_source == (13 if layer.is_sliding else 14)
    assert all(layer.owns_kv for layer in cfg.layers[:15])


@pytest.mark.parametrize("variant", list(SPEC))
def test_every_cut_keeps_the_published_layer_shapes(variant):
    """--layers N for every N: a valid config (parse_config checks KV sources), the last layer full, each
    layer's tensors shaped as the published layer of its type, and KV sharing only with a source."""
    full_cfg, full_t = _shapes(variant)
    by_type = {}
    for layer in full_cfg.layers:
        if layer.owns_kv:
            by_type.setdefault(layer.layer_type, {k.split(".", 2)[2]: v for k, v in full_t.items()
                                                  if k.startswith(f"layers.{layer.index}.")})
    for n in range(1, full_cfg.num_hidden_layers + 1):
        cfg, t = _shapes(variant, n)
        assert cfg.num_hidden_layers == n and cfg.layers[-1].layer_type == FULL
        assert [layer.layer_type for layer in cfg.layers[:-1]] == [x.layer_type for x in full_cfg.layers[:n - 1]]
        assert t["embed_tokens.weight"] == full_t["embed_tokens.weight"]
        if cfg.has_ple:
            assert t["embed_tokens_per_layer.weight"] == (262144, 256 * n)
        for layer in cfg.layers:
            mine = {k.split(".", 2)[2]: v for k, v in t.items() if k.startswith(f"layers.{layer.index}.")}
            want = by_type[layer.layer_type]
            if not layer.owns_kv:  # shared layers drop k/v and (E2B) double the MLP
                want = {k: v for k, v in want.items() if not k.startswith(("self_attn.k_", "self_attn.v_"))}
                if full_cfg.layers[-1].ffn_width != full_cfg.layers[0].ffn_width:
                    H, I = want["mlp.down_proj.weight"]  # noqa: E741 - I: the intermediate size (spec)
                    want = {**want, "mlp.gate_proj.weight": (2 * I, H), "mlp.up_proj.weight": (2 * I, H),
                            "mlp.down_proj.weight": (H, 2 * I)}
            assert mine == want, (variant, n, layer.index)
    assert _shapes("e2b", 10)[0].num_kv_shared_layers == 5  # 20/35 of 10, prefix ending (sliding, full)


def test_streamed_writer_writes_the_same_bytes(tmp_path):
    rng = np.random.default_rng(3)
    tensors = {"b.w": rng.standard_normal((37, 5)), "a.norm": rng.uniform(0.5, 1.5, 11),
               "c": rng.standard_normal((2, 3, 4))}
    for dtype in ("BF16", "F32", "F64"):
        write_safetensors(tmp_path / "one.safetensors", tensors, dtype, metadata={"k": "v"})

        def pieces(x, size):
            flat = x.reshape(-1)
            return lambda: (flat[i:i + size] for i in range(0, flat.size, size))

        streamed = {name: (x.shape, pieces(x, 7)) for name, x in tensors.items()}
        # in the writer's thread; 1, 2 and more workers than tensors; a budget of nothing, of one chunk, the default
        for ahead, budget in itertools.product((0, 1, 2, 5), (0, 7 * 8, None)):
            seen = []
            write_safetensors_streamed(tmp_path / "two.safetensors", streamed, dtype, metadata={"k": "v"},
                                       progress=lambda done, total, seen=seen: seen.append((done, total)), ahead=ahead,
                                       budget_bytes=budget)
            assert (tmp_path / "one.safetensors").read_bytes() == (tmp_path / "two.safetensors").read_bytes(), ahead
            assert seen[-1][0] == seen[-1][1] and all(a <= b for (a, _), (b, _) in itertools.pairwise(seen))
    for ahead in (0, 2):
        bad = {"x": ((4, 4), lambda: iter([np.zeros(15)]))}
        with pytest.raises(ValueError, match=r"tensor 'x': the chunks hold 15 values, its shape \[4, 4\] needs 16"):
            write_safetensors_streamed(tmp_path / "bad.safetensors", bad, ahead=ahead)


def test_the_workers_run_ahead_within_the_budget(tmp_path):
    """With a slow writer the workers draw the later tensors ahead as far as the budget lets them, beyond the
    AHEAD_QUEUE chunks a tensor (what each held at most before: the large tensors were then drawn one after
    another while the writer waited), and never further: the chunks drawn and not yet written stay within the
    budget, AHEAD_QUEUE chunks of the writer's tensor, one chunk in each worker's hands and one in the writer's."""
    lock, drawn, written, outstanding = threading.Lock(), [0], [0], []
    chunk_bytes, workers, budget = 16 * 4, 3, 30 * 16 * 4  # F32 chunks of 16 values; 30 chunks of budget

    def chunks(seed):
        def draw():
            for k in range(40):
                with lock:
                    drawn[0] += chunk_bytes
                    outstanding.append(drawn[0] - written[0])
                yield np.full(16, seed + k, dtype=np.float64)
        return draw

    def slow_writer(done, total):
        with lock:
            written[0] = done
        time.sleep(0.002)

    tensors = {f"t{i}": ((40 * 16,), chunks(100 * i)) for i in range(6)}
    write_safetensors_streamed(tmp_path / "model.safetensors", tensors, "F32", progress=slow_writer, ahead=workers,
                               budget_bytes=budget)
    assert max(outstanding) <= budget + (AHEAD_QUEUE + workers + 1) * chunk_bytes
    # twice what AHEAD_QUEUE queued and one in hand a tensor (the most before: 3 tensors ahead, 10 chunks) allow
    assert max(outstanding) > 2 * workers * (AHEAD_QUEUE + 1) * chunk_bytes
    store = TensorStore(tmp_path)
    assert all(np.array_equal(store.get(f"t{i}"), np.repeat(100 * i + np.arange(40.0), 16)) for i in range(6))


def test_the_budget_is_a_share_of_the_memory_available(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       33554432 kB\nMemFree:         1048576 kB\nMemAvailable:    4194304 kB\n")
    assert ahead_bytes(str(meminfo)) == (4 << 30) // 4  # a quarter of 4 GiB available
    meminfo.write_text("MemAvailable:   67108864 kB\n")
    assert ahead_bytes(str(meminfo)) == AHEAD_BYTES == 2 << 30  # 64 GiB available: the cap
    pages = {"SC_AVPHYS_PAGES": 1 << 18, "SC_PAGE_SIZE": 4096}  # 1 GiB free
    monkeypatch.setattr(safetensors_stream.os, "sysconf", pages.__getitem__)
    assert ahead_bytes(str(tmp_path / "absent")) == (1 << 30) // 4  # no /proc: a quarter of the free pages
    def unknown(name):
        raise ValueError(f"unrecognized configuration name {name}")

    monkeypatch.setattr(safetensors_stream.os, "sysconf", unknown)
    assert ahead_bytes(str(tmp_path / "absent")) == AHEAD_BYTES  # nor those: the cap


def test_streamed_writer_ahead_raises_a_tensors_error_and_stops_its_threads(tmp_path):
    """With tensors drawn ahead on threads, an error while drawing one reaches the writer (raised there, not
    lost in its thread), and every thread ends: those waiting for room in the budget (one chunk's) and those
    still drawing."""
    def endless():
        while True:
            yield np.ones(3)

    def failing():
        yield np.ones(3)
        raise RuntimeError("drawing failed")

    tensors = {"a": ((6,), lambda: iter([np.ones(3)] * 2)), "b": ((6,), failing), "c": ((9,), endless),
               "d": ((9,), endless)}
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="drawing failed"):
        write_safetensors_streamed(tmp_path / "x.safetensors", tensors, ahead=3, budget_bytes=6)
    assert threading.active_count() == before
    with pytest.raises(ValueError, match=r"tensor 'c': the chunks hold 12 values, its shape \[9\] needs 9"):
        write_safetensors_streamed(tmp_path / "y.safetensors", {"c": tensors["c"], "d": tensors["d"]}, ahead=2,
                                   budget_bytes=6)
    assert threading.active_count() == before


@pytest.fixture
def tiny_published(monkeypatch):
    """A published-style variant small enough for a test: E2B's structure (PLE, KV sharing, double-wide)
    at H 64, vocabulary 512."""
    spec = dict(PUBLISHED["e2b"], hidden_size=64, num_attention_heads=4, intermediate_size=96,
                hidden_size_per_layer_input=8, sliding_window=8, description="tiny")
    monkeypatch.setitem(PUBLISHED, "tiny", spec)
    monkeypatch.setitem(PUBLISHED_COMMON, "vocab_size", 512)
    monkeypatch.setitem(PUBLISHED_COMMON, "vocab_size_per_layer_input", 512)
    monkeypatch.setitem(PUBLISHED_COMMON, "head_dim", 16)
    monkeypatch.setitem(PUBLISHED_COMMON, "global_head_dim", 32)
    return "tiny"


def test_streamed_checkpoint_does_not_depend_on_the_chunk_size(tiny_published, tmp_path, monkeypatch):
    a = write_published_checkpoint(tiny_published, 5, tmp_path / "a", layers=10)
    monkeypatch.setattr(synth, "CHUNK_VALUES", 1000)  # many chunks per tensor
    b = write_published_checkpoint(tiny_published, 5, tmp_path / "b", layers=10)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    for ahead in (0, 7):  # nor on how many tensors are drawn ahead on threads (threads() of this machine above)
        monkeypatch.setattr(synth, "threads", lambda ahead=ahead: ahead)
        c = write_published_checkpoint(tiny_published, 5, tmp_path / f"c{ahead}", layers=10)
        assert (a / "model.safetensors").read_bytes() == (c / "model.safetensors").read_bytes(), ahead
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["num_kv_shared_layers"] == 5 and cfg["use_double_wide_mlp"] and cfg["dtype"] == "bfloat16"
    store = TensorStore(a)
    assert {info.dtype for info in store.infos.values()} == {"BF16"}
    norms = store.get("model.layers.0.input_layernorm.weight")
    assert norms.min() >= 0.5 and norms.max() <= 1.5  # the distribution rules of _draw


def test_forward_reads_tables_by_rows_and_the_head_in_chunks(tiny_published, tmp_path, monkeypatch):
    """No embedding table is decoded whole; the head is decoded HEAD_CHUNK rows at a time (here 100),
    and the logits equal those of an unchunked head
    (up to the rounding of BLAS's blocking)."""
    d = write_published_checkpoint(tiny_published, 1, tmp_path / "m", layers=10)
    model = Gemma4(d)
    reads = []  # (name, first row, rows) of every decoding read
    real_read = TensorStore.read

    def read(self, name, start=0, stop=None, dtype=np.float64, out=None):
        got = real_read(self, name, start, stop, dtype, out)
        reads.append((name, start, got.shape[0] if got.ndim else 1))
        return got

    monkeypatch.setattr(TensorStore, "read", read)
    monkeypatch.setattr("refimpl.model.HEAD_CHUNK", 100)
    ids = np.arange(2, 22)
    chunked = model.forward(ids, rows="all")
    tables = [(n, a, r) for n, a, r in reads if "embed_tokens" in n]
    assert all(n.endswith("embed_tokens.weight") for n, _, _ in tables)  # the PLE table is only gathered
    assert [(a, r) for _, a, r in tables] == [(0, 100), (100, 100), (200, 100), (300, 100), (400, 100), (500, 12)]
    monkeypatch.setattr("refimpl.model.HEAD_CHUNK", 1 << 20)
    assert np.max(np.abs(model.forward(ids, rows="all") - chunked)) < 1e-12  # BLAS blocking: rounding only
    assert 1024 <= HEAD_CHUNK <= 16384  # the real chunk: tens of MB of float64 at real width, not the table


def test_synth_cli_published(tmp_path, capsys, monkeypatch):
    assert cli_main(["synth", "--preset", "e2b-mini", "--layers", "3", "--out", str(tmp_path / "x")]) == 2
    assert "refimpl: error: --layers applies to the published-shape presets" in capsys.readouterr().err
    assert cli_main(["synth", "--preset", "e2b", "--layers", "36", "--out", str(tmp_path / "x")]) == 2
    assert "refimpl: error: --layers must be an integer in [1, 35] for e2b, got 36" in capsys.readouterr().err
    monkeypatch.setattr(shutil, "disk_usage", lambda p: namedtuple("U", "total used free")(1, 1, 10 * 2**30))
    assert cli_main(["synth", "--preset", "31b", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    need = float(err.split("the checkpoint needs ")[1].split(" GiB")[0])
    assert 2 * 30e9 / 2**30 < need < 2 * 32e9 / 2**30  # a 31B model in bf16
    assert "GiB, but only 10.0 GiB are free; choose another --out or fewer --layers" in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_an_interrupted_synth_leaves_no_partial_checkpoint(tmp_path, sig, code):
    """A CI job's timeout (SIGTERM) or Ctrl-C in the middle of a real-size synth: the half-written checkpoint
    (the hidden directory beside --out; 45 GiB of a 31B when it happened on the device) is removed, the exit
    says which signal, and --out is not made. Python's default SIGTERM would end it without the cleanup."""
    out = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-m", "refimpl", "synth", "--preset", "26b-a4b", "--layers", "1",
                             "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:  # one line per 10% (stderr is not a terminal)
        lines.append(line)
        if "weights  10%" in line:
            break
    partial = [p.name for p in tmp_path.iterdir()]
    assert len(partial) == 1 and partial[0].startswith(".ck."), lines  # the weights being written
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert err.splitlines()[-1] == f"refimpl: interrupted by {sig.name}"
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------------
# rows pruned before the KV-shared layers


def _rows_cases(model, T):
    return [[T - 1], [0, T // 2, T - 1], [3, 3, 1]]


@pytest.mark.parametrize("preset", ["e2b-mini", "all-features"])
def test_pruned_rows_equal_the_full_pass(preset_models, preset):
    """forward(rows=R) runs the KV-shared layers on R only: every row equals the full pass's row (to
    BLAS rounding), also after a cache, and the cache it leaves equals the full pass's."""
    from refimpl.model import KVCache

    model = preset_models[preset]
    assert model.cfg.num_kv_shared_layers > 0
    ids = list(np.random.default_rng(4).integers(5, 500, 30))
    full = model.forward(ids, rows="all")
    for rows in _rows_cases(model, len(ids)):
        assert np.max(np.abs(model.forward(ids, rows=rows) - full[rows])) < 1e-12
    a, b = KVCache(), KVCache()
    model.forward(ids[:17], rows=[16], cache=a)
    model.forward(ids[:17], rows="all", cache=b)
    for i in b.layers:
        assert np.array_equal(a.layers[i].k, b.layers[i].k) and np.array_equal(a.layers[i].pos, b.layers[i].pos)
    assert np.max(np.abs(model.forward(ids[17:], rows=[0, 12], cache=a) - full[[17, 29]])) < 1e-12


def test_pruned_rows_keep_vision_blocks(micro_factory):
    """A vision-bidirectional checkpoint with KV-shared layers: a kept row inside an image block still
    sees the later keys of its block on the shared sliding layers (their block ids come with the K/V)."""
    from helpers import micro_config

    d = micro_factory(micro_config(num_hidden_layers=5, layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL],
                                   num_kv_shared_layers=2, use_bidirectional_attention="vision", sliding_window=6))
    model = Gemma4(d)
    ids = list(range(5, 25))
    blocks = [-1] * 4 + [0] * 5 + [-1] * 3 + [1] * 4 + [-1] * 4
    full = model.forward(ids, rows="all", vision_blocks=blocks)
    causal = model.forward(ids, rows="all")
    assert np.max(np.abs(full[5] - causal[5])) > 1e-6  # the block matters for a row inside it
    for rows in ([5], [4, 5, 13, 19], [19]):
        assert np.max(np.abs(model.forward(ids, rows=rows, vision_blocks=blocks) - full[rows])) < 1e-12


@pytest.mark.parametrize("shared", [2, 1, 0])  # the pruned layer: full, sliding, the last one
def test_the_last_layer_with_kv_runs_only_the_kept_queries(micro_factory, monkeypatch, shared):
    """With rows pruned, the last layer that makes K/V (the last layer, without KV sharing) makes them
    from every token but asks queries for the kept rows only; the rows equal the full pass's, and so do
    the rows after a cache left by a pruned call."""
    from helpers import micro_config

    import refimpl.model as model_module
    from refimpl.model import KVCache

    d = micro_factory(micro_config(num_hidden_layers=5, layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL],
                                   num_kv_shared_layers=shared))
    model = Gemma4(d)
    seen = []  # (queries, keys) of each attention call
    attention = model_module.attention
    monkeypatch.setattr(model_module, "attention",
                        lambda q, k, v, mask: seen.append((q.shape[0], k.shape[0])) or attention(q, k, v, mask))
    ids = list(range(5, 25))
    full = model.forward(ids, rows="all")
    seen.clear()
    got = model.forward(ids, rows=[4, 19])
    owner = model.cfg.first_shared_layer - 1
    assert seen == [(20, 20)] * owner + [(2, 20)] * (5 - owner)
    assert np.max(np.abs(got - full[[4, 19]])) < 1e-12
    cache = KVCache()
    model.forward(ids[:12], rows="last", cache=cache)
    assert np.max(np.abs(model.forward(ids[12:], rows="all", cache=cache) - full[12:])) < 1e-12


def test_kept_rows_with_a_trace(preset_models):
    """hidden_states(keep=R) with a trace runs every row (the trace holds all T) and returns the R rows."""
    from refimpl.model import Trace

    model = preset_models["e2b-mini"]
    ids = list(range(5, 25))
    trace = Trace()
    x = model.hidden_states(ids, keep=np.array([3, 19]), trace=trace)
    assert x.shape == (2, model.cfg.hidden_size)
    assert trace.tensors[f"layers.{model.cfg.num_hidden_layers - 1}.residual"].shape[0] == 20
    assert np.max(np.abs(x - model.hidden_states(ids)[[3, 19]])) < 1e-12


# ----------------------------------------------------------------------------------------------
# streamed products and the decoded-weight cache


@pytest.mark.parametrize("rows", [1, 16, 17])
def test_streamed_product_on_threads_equals_the_decoded_product(tiny_published, tmp_path, monkeypatch, rows):
    """product() streams the weight in blocks (at most FEW_ROWS rows) split between threads, or decodes it
    into a reused buffer (more rows): both equal x @ W.T with W decoded whole, on one thread or three
    (within the rounding of BLAS's blocking)."""
    import refimpl.weights as weights
    from refimpl.threads import use_threads

    d = write_published_checkpoint(tiny_published, 2, tmp_path / "m", layers=10)
    w = Gemma4(d).weights
    monkeypatch.setattr(weights, "STREAM_VALUES", 300)  # 4 rows of 64 per block: many blocks
    name = w.prefix + "layers.7.mlp.gate_proj.weight"  # a double-wide [192, 64] weight
    x = np.random.default_rng(3).standard_normal((rows, 64))
    want = x @ w.store.get(name).T
    by_threads = {}
    for threads in (1, 3):
        with use_threads(threads):
            by_threads[threads] = w.product(x, name)
            assert np.max(np.abs(by_threads[threads] - want)) < 1e-13
            assert np.max(np.abs(w.product(x, name, 10, 50) - want[:, 10:50])) < 1e-13  # rows of W
    assert np.max(np.abs(by_threads[1] - by_threads[3])) < 1e-13


def test_weight_cache_keeps_decoded_weights_within_its_budget(tiny_published, tmp_path, monkeypatch):
    """weight_cache: a forward with every weight cached equals the streamed one (to BLAS rounding), the
    next forward decodes nothing the cache holds, and a budget keeps the first weights that fit."""
    d = write_published_checkpoint(tiny_published, 3, tmp_path / "m", layers=10)
    ids = np.arange(2, 40)
    streamed = Gemma4(d).forward(ids, rows=[5, 37])
    model = Gemma4(d, weight_cache="all")
    assert np.max(np.abs(model.forward(ids, rows=[5, 37]) - streamed)) < 1e-12
    reads = []
    real_read = TensorStore.read
    monkeypatch.setattr(TensorStore, "read",
                        lambda self, name, *a, **k: reads.append(name) or real_read(self, name, *a, **k))
    assert np.max(np.abs(model.forward(ids, rows=[5, 37]) - streamed)) < 1e-12
    assert not [n for n in reads if n.endswith("_proj.weight") or "embed_tokens" in n]  # only norms re-read
    assert model.weights.cache_bytes == sum(a.nbytes for a in model.weights.cache.values())

    first = next(iter(model.weights.cache.values())).nbytes  # input order: layer 0's q_proj comes first
    small = Gemma4(d, weight_cache=first + 8)
    assert np.max(np.abs(small.forward(ids, rows=[5, 37]) - streamed)) < 1e-12
    assert list(small.weights.cache) == [next(iter(model.weights.cache))] and small.weights.cache_bytes == first


def test_weight_cache_size_parsing(monkeypatch, tmp_path):
    from refimpl.errors import InputError
    from refimpl.weights import AUTO_CACHE, weight_cache_bytes

    assert weight_cache_bytes(0) == 0 and weight_cache_bytes(1234) == 1234
    assert weight_cache_bytes("12GiB") == 12 * 2**30 and weight_cache_bytes("1.5 mib") == 3 * 2**19
    assert weight_cache_bytes("all") > 2**60
    monkeypatch.delenv("REFIMPL_WEIGHT_CACHE", raising=False)
    assert weight_cache_bytes(None) == AUTO_CACHE  # "auto": off on the CPU, 80% of the free memory on a GPU
    monkeypatch.setenv("REFIMPL_WEIGHT_CACHE", "2KiB")
    assert weight_cache_bytes(None) == 2048
    monkeypatch.setenv("REFIMPL_WEIGHT_CACHE", "lots")
    with pytest.raises(InputError) as e:
        weight_cache_bytes(None)
    assert str(e.value) == ("REFIMPL_WEIGHT_CACHE='lots': the weight cache size must be a number of bytes, a size "
                            "such as '12GiB' or '512MiB', '0' (off), 'all' or 'auto'")
    for bad in (-1, "12GB", "-3MiB", True, "nanGiB"):
        with pytest.raises(InputError, match="the weight cache size must be"):
            weight_cache_bytes(bad)
