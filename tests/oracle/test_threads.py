"""refimpl.threads: the oracle's own steps on many threads compute what one thread computes.

Row blocks run the unchanged step on each block, so every element is computed by the same NumPy calls
in the same order; the tests still bound the differences by the rounding of float64 (or float32) rather
than asserting equal bits. The whole forward on one and on several threads also differs in its BLAS
calls (a matrix-vector product split into blocks), so it is held to the bound other tests use for
BLAS's blocking (1e-12 on logits of about 10)."""

from __future__ import annotations

import _thread
import itertools
import os
import signal
import threading
import time

import numpy as np
import pytest
from helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import refimpl.safetensors_io as sio
import refimpl.weights as weights
from refimpl import ops, schedule, threads
from refimpl.errors import InputError
from refimpl.model import KVCache, rope_cos_sin

ULPS = 2  # a row-blocked step against the step in one call, in units of the dtype's epsilon (relative)


def within_rounding(got: np.ndarray, want: np.ndarray) -> bool:
    eps = np.finfo(want.dtype).eps
    scale = np.maximum(np.abs(want), np.finfo(want.dtype).tiny)
    return (got.shape == want.shape and got.dtype == want.dtype
            and bool(np.all(np.abs(got - want) <= ULPS * eps * scale)))


@pytest.fixture
def recorded_parts(monkeypatch):
    """Every in_parts call that split its work: (the caller's module, total, [(first, last), ...]) from the parts'
    own records."""
    calls = []
    real = threads.in_parts

    def in_parts(total, work, *args, **kwargs):
        seen = []

        def recording(first, last):
            seen.append((first, last))
            work(first, last)

        real(total, recording, *args, **kwargs)
        if len(seen) > 1:
            calls.append((work.__module__.rsplit(".", 1)[-1], total, sorted(seen)))

    for module in (threads, weights, sio, schedule):  # each module calls the name it imported
        monkeypatch.setattr(module, "in_parts", in_parts)
    return calls


# ----------------------------------------------------------------------------------------------
# in_parts and the pool


@settings(max_examples=examples(60), deadline=None)
@given(total=st.integers(0, 400), unit=st.integers(1, 17), least=st.integers(1, 3), n=st.integers(1, 6))
def test_in_parts_covers_the_range_once_in_whole_units(total, unit, least, n):
    seen, lock = [], threading.Lock()

    def work(first, last):
        with lock:
            seen.append((first, last))

    with threads.use_threads(n):
        threads.in_parts(total, work, unit=unit, least=least)
    seen.sort()
    assert seen[0][0] == 0 and seen[-1][1] == total
    assert all(a[1] == b[0] for a, b in itertools.pairwise(seen))  # contiguous, no overlap
    assert len(seen) <= n
    if len(seen) > 1:
        assert all(first % unit == 0 and last - first >= least * unit for first, last in seen[:-1])
        assert seen[-1][1] - seen[-1][0] >= least * unit


def test_in_parts_runs_on_several_threads_and_nested_work_inline():
    idents, nested = {}, []
    together = threading.Barrier(4, timeout=30)  # the four parts run at the same time

    def work(first, last):
        idents[(first, last)] = threading.get_ident()
        together.wait()
        threads.in_parts(100, lambda a, b: nested.append((a, b, threading.get_ident())), unit=1)

    with threads.use_threads(4):
        threads.in_parts(40, work, unit=10)
    assert len(idents) == 4 and len(set(idents.values())) == 4
    assert idents[(0, 10)] == threading.get_ident()  # the caller runs the first part
    # a part's own in_parts runs its whole range in the part's thread
    assert sorted((a, b) for a, b, _ in nested) == [(0, 100)] * 4
    assert {t for _, _, t in nested} == set(idents.values())


def test_in_parts_raises_a_failing_part_after_every_part_ends():
    done = []

    def work(first, last):
        if first == 10:
            raise ValueError("part 2 failed")
        time.sleep(0.2)  # the failing part ends first
        done.append(first)

    with threads.use_threads(3), pytest.raises(ValueError, match="part 2 failed"):
        threads.in_parts(30, work, unit=10)
    assert sorted(done) == [0, 20]


def test_parts_see_the_thread_count_of_their_call(monkeypatch):
    monkeypatch.setenv(threads.THREADS_ENV, "3")
    seen = []

    def work(first, last):
        os.environ[threads.THREADS_ENV] = "not read inside a part"
        seen.append(threads.threads())

    threads.in_parts(30, work, unit=10)
    assert seen == [3, 3, 3]
    monkeypatch.setenv(threads.THREADS_ENV, "bad")
    with pytest.raises(InputError, match="REFIMPL_THREADS='bad'"):
        threads.threads()  # outside a part, the environment is read again


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="no pthread_kill on this platform")
@pytest.mark.parametrize("where", ["while waiting for the parts", "in the caller's own part", "after a wait"])
def test_an_interrupt_is_raised_and_the_pool_still_works(where):
    """Ctrl-C (a SIGINT to the main thread) in each place; "after a wait": ``_thread.interrupt_main`` wakes no
    waiting call, so the interrupt is raised just after a part has ended (an earlier pool then waited for ever)."""
    done = []

    def work(first, last):
        if first == 0 and where == "in the caller's own part":
            time.sleep(2)  # the interrupt lands here
        elif first > 0:
            time.sleep(0.4)  # a part that is still running when the interrupt comes
        done.append(first)

    main = threading.main_thread().ident  # a real SIGINT to the main thread, as Ctrl-C sends: it wakes a waiting call
    timer = (threading.Timer(0.1, _thread.interrupt_main) if where == "after a wait"
             else threading.Timer(0.1, signal.pthread_kill, (main, signal.SIGINT)))
    with threads.use_threads(3):
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            threads.in_parts(30, work, unit=10)
        timer.join()
        assert time.monotonic() - t0 < 1.5  # raised without waiting for the caller's own part to end
        if where == "in the caller's own part":
            assert sorted(done) == [10, 20]  # the other parts ended before the interrupt was raised
        time.sleep(0.5)  # parts of the interrupted call that may still run end
        seen = []
        threads.in_parts(30, lambda a, b: seen.append((a, b)), unit=10)  # the next call: every part, once
    assert sorted(seen) == [(0, 10), (10, 20), (20, 30)]


def test_a_second_caller_runs_its_parts_itself_while_the_pool_is_busy():
    inside, release = threading.Event(), threading.Event()
    seen = []

    def first(a, b):  # holds the pool until the second caller has run
        inside.set()
        release.wait(30)

    def second():
        threads.in_parts(40, lambda a, b: seen.append((a, b, threading.get_ident())), unit=10)

    with threads.use_threads(4):
        caller = threading.Thread(target=threads.in_parts, args=(40, first), kwargs={"unit": 10})
        caller.start()
        assert inside.wait(30)
        other = threading.Thread(target=second)
        other.start()
        other.join(30)
        release.set()
        caller.join(30)
        assert seen == [(0, 40, other.ident)]  # whole, in its own thread: the pool was taken
        seen.clear()
        second()  # the pool is free again: four parts
    assert sorted((a, b) for a, b, _ in seen) == [(0, 10), (10, 20), (20, 30), (30, 40)]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_the_pool_is_made_again_in_a_forked_child():
    with threads.use_threads(3):
        threads.in_parts(3, lambda a, b: None)  # the parent's pool exists
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the parent's pool threads did not survive the fork
            try:
                idents, together = set(), threading.Barrier(3, timeout=30)
                threads.in_parts(3, lambda a, b: idents.add(threading.get_ident()) or together.wait())
                os.write(write, str(len(idents)).encode())
            finally:
                os._exit(0)  # never back into pytest
        os.close(write)
        got = os.read(read, 16).decode()
        os.waitpid(pid, 0)
    assert got == "3"


def test_thread_count_from_the_environment(monkeypatch):
    for var in (threads.THREADS_ENV, *threads.BLAS_VARS):
        monkeypatch.delenv(var, raising=False)
    assert threads.threads() == threads.cores() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.threads() == 3  # as conformance generate sets it for a worker
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "64")
    assert threads.threads() == 64
    monkeypatch.setenv(threads.THREADS_ENV, "5")
    assert threads.threads() == 5
    with threads.use_threads(2):
        assert threads.threads() == 2
    assert threads.threads() == 5
    monkeypatch.setenv(threads.THREADS_ENV, "many")
    with pytest.raises(InputError) as e:
        threads.threads()
    assert str(e.value) == "REFIMPL_THREADS='many': the oracle's thread count must be a positive integer"
    with pytest.raises(ValueError, match="threads must be a positive integer, got 0"):
        with threads.use_threads(0):
            pass


def test_blas_on_one_thread_restores_the_count():
    api = threads._openblas_threads()
    if api is None:
        pytest.skip("NumPy does not use OpenBLAS here: blas_on_one_thread is a no-op")
    get, _ = api
    before = get()
    with threads.blas_on_one_thread():
        assert get() == 1
    assert get() == before


def test_scaled_blocks_grow_with_threads():
    sizes = {}
    for n in (1, 2, 4, 7, 8, 15, 16, 64):
        with threads.use_threads(n):
            sizes[n] = threads.scaled(1000)
    assert sizes == {1: 1000, 2: 1000, 4: 1000, 7: 1000, 8: 2000, 15: 3000, 16: 4000, 64: 4000}


# ----------------------------------------------------------------------------------------------
# row-blocked steps


def _steps(rng, dtype):
    T, N, D, H = 37, 4, 16, 24
    x = rng.standard_normal((T, H)).astype(dtype)
    q = rng.standard_normal((T, N, D)).astype(dtype)
    scores = rng.standard_normal((2, 3, T, T)).astype(dtype)
    scores[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] = -np.inf
    cos, sin = (a.astype(dtype) for a in rope_cos_sin(np.arange(T), 1.0 / 10000 ** (np.arange(0, D, 2) / D)))
    return {
        "rms_norm [T, H]": (schedule.rms_norm, (x, rng.standard_normal(H).astype(dtype), 1e-6), {}),
        "rms_norm [T, N, D], no weight": (schedule.rms_norm, (q, None, 1e-6), {}),
        "layer_norm": (schedule.layer_norm, (x, rng.standard_normal(H).astype(dtype),
                                             rng.standard_normal(H).astype(dtype), 1e-5), {}),
        "gelu_tanh": (schedule.gelu_tanh, (4 * x,), {}),
        "softmax of masked scores": (schedule.softmax, (scores,), {"axis": -1}),
        "softmax along axis 0": (schedule.softmax, (np.nan_to_num(scores, neginf=-5.0),), {"axis": 0}),
        "softcap": (schedule.softcap, (40 * x, 30.0), {}),
        "apply_rope": (schedule.apply_rope, (q, cos, sin), {}),
        "norm_rope": (schedule.norm_rope, (q, cos, sin, rng.standard_normal(D).astype(dtype), 1e-6), {}),
        "geglu": (schedule.geglu, (4 * x, x), {}),
    }


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_rowwise_steps_equal_the_step_in_one_call(monkeypatch, recorded_parts, dtype, n):
    monkeypatch.setattr(threads, "ROWWISE_BLOCK", 64)  # blocks of a few rows: these small inputs split
    for name, (fn, args, kwargs) in _steps(np.random.default_rng(n), dtype).items():
        recorded_parts.clear()
        with threads.use_threads(n):
            got = fn(*args, **kwargs)
        with threads.use_threads(1):  # (norm_rope's whole step calls two row-blocked steps)
            want = fn.whole(*args, **kwargs)
        assert within_rounding(got, want), name
        split = name != "softmax along axis 0"  # not along its rows: one call
        assert bool(recorded_parts) == split, name
        if split:
            ((_, total, parts),) = recorded_parts
            assert 1 < len(parts) <= n, name


@pytest.mark.parametrize("cap", [30.0, None])
def test_softcap_into_columns_of_the_logits(monkeypatch, recorded_parts, cap):
    """softcap(z, cap, out=logits[:, a:b]) writes each row block straight into those columns (the LM head's
    chunks): the same values as the step in one call, the rest of the logits untouched."""
    monkeypatch.setattr(threads, "ROWWISE_BLOCK", 64)
    z = 40 * np.random.default_rng(8).standard_normal((30, 16))
    logits = np.full((30, 50), 7.0)
    with threads.use_threads(3):
        got = schedule.softcap(z, cap, out=logits[:, 20:36])
    assert recorded_parts and recorded_parts[0][1] == 30  # split into row blocks
    assert np.shares_memory(got, logits) and got.shape == (30, 16)
    want = z if cap is None else cap * np.tanh(z / cap)
    assert within_rounding(logits[:, 20:36], want)
    assert (logits[:, :20] == 7.0).all() and (logits[:, 36:] == 7.0).all()


def test_all_finite_splits_rows_and_finds_one_bad_value_anywhere(monkeypatch, recorded_parts):
    monkeypatch.setattr(threads, "ROWWISE_BLOCK", 64)
    x = np.random.default_rng(9).standard_normal((40, 16))
    with threads.use_threads(4):
        assert threads.all_finite(x)
        assert recorded_parts and recorded_parts[0][1] == 40 and len(recorded_parts[0][2]) == 4
        for bad, (r, c) in ((np.nan, (0, 0)), (np.inf, (39, 15)), (-np.inf, (21, 3))):
            y = x.copy()
            y[r, c] = bad
            assert not threads.all_finite(y)
    assert threads.all_finite(np.float64(1.0)) and not threads.all_finite(np.array(np.nan))
    assert threads.all_finite(np.empty((0, 3))) and threads.all_finite(np.empty((3, 0)))
    flat = np.arange(300.0)
    with threads.use_threads(4):
        assert threads.all_finite(flat)
        flat[250] = np.nan
        assert not threads.all_finite(flat)


def test_rowwise_takes_keywords_the_last_axis_by_number_and_the_step_s_dtype(monkeypatch, recorded_parts):
    monkeypatch.setattr(threads, "ROWWISE_BLOCK", 64)
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((40, 24)), rng.standard_normal(24)
    q = rng.standard_normal((40, 4, 16))
    cos, sin = rope_cos_sin(np.arange(40), 1.0 / 10000 ** (np.arange(0, 16, 2) / 16))
    scores = rng.standard_normal((2, 3, 40, 40))
    with threads.use_threads(3):
        got = {
            "keywords": (schedule.rms_norm(x=x, weight=w, eps=1e-6), schedule.rms_norm.whole(x, w, 1e-6)),
            "aligned keywords": (schedule.apply_rope(q, cos=cos, sin=sin), schedule.apply_rope.whole(q, cos, sin)),
            "axis by number": (schedule.softmax(scores, 3), schedule.softmax.whole(scores, -1)),
            "float32 x, float64 weights": (schedule.layer_norm(x.astype(np.float32), w, w, 1e-5),
                                           schedule.layer_norm.whole(x.astype(np.float32), w, w, 1e-5)),
        }
    assert len(recorded_parts) == len(got)  # each one split
    for name, (blocked, whole) in got.items():
        assert within_rounding(blocked, whole), name
    recorded_parts.clear()
    with threads.use_threads(3):
        flat = schedule.softmax(rng.standard_normal(4096))  # one row of a flat step: never split
    assert recorded_parts == [] and abs(flat.sum() - 1.0) < 1e-12


def test_rowwise_steps_run_in_one_call_on_one_thread_or_small_inputs(monkeypatch, recorded_parts):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 30))
    with threads.use_threads(1):
        schedule.gelu_tanh(x)
    monkeypatch.setattr(threads, "ROWWISE_BLOCK", x.size)  # one block: nothing to split
    with threads.use_threads(4):
        schedule.gelu_tanh(x)
    assert recorded_parts == []


def test_rowwise_refuses_a_step_that_is_not_row_wise(monkeypatch):
    monkeypatch.setattr(threads, "ROWWISE_BLOCK", 8)

    @threads.rowwise()
    def narrow(x):
        return x[:, :2]

    with threads.use_threads(2), pytest.raises(TypeError, match=r"narrow is not row-wise: rows of float32 \[\d+, 4\] "
                                                                r"gave float32 \[\d+, 2\]"):
        narrow(np.ones((20, 4), dtype=np.float32))
    with pytest.raises(ValueError, match="a flat step has one row-aligned argument"):
        threads.rowwise(aligned=2, flat=True)


def naive_attention(q, k, v, mask):
    """Attention one query head and one row at a time, in plain Python sums over NumPy rows (no matrix product)."""
    T, N, D = q.shape
    G = N // k.shape[1]
    out = np.zeros_like(q)
    for t in range(T):
        for n in range(N):
            keys = np.flatnonzero(mask[t])
            s = np.array([np.dot(q[t, n], k[j, n // G]) for j in keys])
            p = np.exp(s - s.max())
            p /= p.sum()
            out[t, n] = sum(pj * v[j, n // G] for pj, j in zip(p, keys, strict=True))
    return out


@pytest.mark.parametrize("K", [1, 2])
def test_attention_by_blocks_of_query_rows_equals_one_call_and_a_naive_loop(monkeypatch, recorded_parts, K):
    monkeypatch.setattr(schedule, "ATTENTION_BLOCK", 16)  # fewer than the [N, S] scores of one row: a block is a row
    rng = np.random.default_rng(3)
    T, S, N, D = 21, 25, 4, 8
    q, k, v = rng.standard_normal((T, N, D)), rng.standard_normal((S, K, D)), rng.standard_normal((S, K, D))
    mask = ops.attention_mask(np.arange(S - T, S), np.arange(S), 6)  # a cached prefix and a window
    with threads.use_threads(1):
        one = schedule.attention(q, k, v, mask)
    with threads.use_threads(4):
        four = schedule.attention(q, k, v, mask)
    # the four-thread call split its T one-row blocks
    assert recorded_parts and recorded_parts[0][:2] == ("schedule", T)
    assert np.max(np.abs(four - one)) <= 1e-14
    assert np.max(np.abs(one - naive_attention(q, k, v, mask))) <= 1e-14


def test_attention_blocks_see_only_their_span_of_keys(monkeypatch):
    """Each block of query rows multiplies only the keys from the first one its rows see to the last: a
    window of 6 over 40 keys gives blocks of 2 rows spans of 7 keys; the blocks and their spans are the
    same on one thread and on four, and the result equals the naive loop's."""
    monkeypatch.setattr(schedule, "ATTENTION_BLOCK", 160)  # [N, S] scores of 2 rows fill a block
    rng = np.random.default_rng(5)
    T, S, N, D = 20, 40, 2, 4
    q, k, v = rng.standard_normal((T, N, D)), rng.standard_normal((S, 1, D)), rng.standard_normal((S, 1, D))
    mask = ops.attention_mask(np.arange(S - T, S), np.arange(S), 6)
    calls = {}
    real = ops.attention
    for n in (1, 4):
        seen = calls[n] = []
        monkeypatch.setattr(ops, "attention", lambda q, k, v, m, seen=seen: seen.append((q.shape[0], k.shape[0]))
                            or real(q, k, v, m))
        with threads.use_threads(n):
            out = schedule.attention(q, k, v, mask)
        assert np.max(np.abs(out - naive_attention(q, k, v, mask))) <= 1e-14
    assert sorted(calls[1]) == sorted(calls[4]) == [(2, 7)] * 10
    assert schedule.key_span(np.zeros((3, 5), dtype=bool)) == (0, 5)  # nothing seen: every key (NaN rows either way)


def test_attention_parts_of_a_causal_prompt_get_equal_work(monkeypatch):
    """A causal block's keys grow with its rows: 16 blocks of 2 rows over 32 keys see 2, 4, ..., 32 keys. Cut in
    row order, four threads would get 20, 52, 84 and 116 (rows x keys / 2); in ``balanced_order`` each gets 68.
    The blocks themselves are those of one thread, and the result the naive loop's."""
    monkeypatch.setattr(schedule, "ATTENTION_BLOCK", 128)  # [N, S] scores of 2 rows fill a block
    rng = np.random.default_rng(6)
    T, N, D = 32, 2, 4
    q, k, v = rng.standard_normal((T, N, D)), rng.standard_normal((T, 1, D)), rng.standard_normal((T, 1, D))
    mask = ops.attention_mask(np.arange(T), np.arange(T), None)
    work: dict[int, int] = {}
    blocks: list[tuple[int, int]] = []
    real = ops.attention

    def counted(q, k, v, m):
        ident = threading.get_ident()
        work[ident] = work.get(ident, 0) + q.shape[0] * k.shape[0] // 2
        blocks.append((q.shape[0], k.shape[0]))
        return real(q, k, v, m)

    monkeypatch.setattr(ops, "attention", counted)
    with threads.use_threads(1):
        schedule.attention(q, k, v, mask)
    one = sorted(blocks)
    blocks.clear()
    work.clear()
    with threads.use_threads(4):
        out = schedule.attention(q, k, v, mask)
    assert sorted(work.values()) == [68] * 4
    assert sorted(blocks) == one == [(2, 2 * (j + 1)) for j in range(16)]
    assert np.max(np.abs(out - naive_attention(q, k, v, mask))) <= 1e-14


def test_balanced_order_pairs_the_first_blocks_with_the_last():
    for n in range(12):
        order = schedule.balanced_order(n)
        assert sorted(order) == list(range(n)), n
        assert all(order[j] + order[j + 1] == n - 1 for j in range(0, n - 1, 2)), n  # each pair: j and n - 1 - j


# ----------------------------------------------------------------------------------------------
# the whole forward


@pytest.mark.parametrize("preset", ["e2b-mini", "26b-a4b-mini"])
def test_forward_on_one_and_on_four_threads_agree(preset_models, monkeypatch, recorded_parts, preset):
    """Prefill (all rows, the last row, some rows) and decode steps through the KV cache, with every threaded
    step splitting (small blocks): equal to one thread's within BLAS rounding."""
    monkeypatch.setattr(threads, "ROWWISE_BLOCK", 64)
    monkeypatch.setattr(weights, "STREAM_VALUES", 300)
    monkeypatch.setattr(sio, "DECODE_BLOCK", 256)
    monkeypatch.setattr(schedule, "ATTENTION_BLOCK", 64)
    model = preset_models[preset]
    ids = np.random.default_rng(7).integers(3, model.cfg.vocab_size, 23)
    runs = {}
    for n in (1, 4):
        with threads.use_threads(n):
            cache = KVCache()
            prefill = model.forward(ids[:20], rows="all", cache=cache)
            steps = [model.forward(ids[i:i + 1], rows="last", cache=cache) for i in range(20, 23)]
            some = model.forward(ids, rows=[3, -1])
            runs[n] = [prefill, *steps, some]
        if n == 1:
            assert recorded_parts == []
            assert np.max(np.abs(runs[1][0])) > 1.0  # logits of a real size
    # decoding, streamed products, row-blocked steps and attention all split
    assert {kind for kind, _, _ in recorded_parts} == {"threads", "weights", "safetensors_io", "schedule"}
    for one, four in zip(runs[1], runs[4], strict=True):
        assert np.max(np.abs(one - four)) < 1e-12
