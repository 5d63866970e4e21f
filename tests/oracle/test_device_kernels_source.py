"""refimpl/device_kernels.py's CUDA source on a machine without a GPU: the raw kernels (a block of threads a row)
compiled as C++ and run with each block's threads as real threads meeting at a barrier for ``__syncthreads``,
against ``ops.py`` on NumPy. What this checks: the indexing, the strided shares and tree reductions, the order of
the operations, the masked rows and NaN; and, with the C library's macros taken away, that the source names only
what NVRTC has (no ``INFINITY``). What it cannot: NVRTC itself and the GPU (tests/oracle/test_cupy.py, on CUDA)."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from refimpl import device_kernels, ops

CXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no g++ to build the kernels' emulation")
EPS = np.finfo(np.float64).eps

# CUDA's names as the host has them; the C library's macros, which NVRTC lacks, taken away
HEADER = r"""
#include <math.h>
#include <string.h>
#include <stdio.h>
#include <stdlib.h>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>
#undef INFINITY
#undef NAN
#undef HUGE_VAL
#define __device__
#define __global__
#define __shared__ static
struct Dim { unsigned x; };
static thread_local Dim threadIdx;
static Dim blockIdx;
struct Barrier {  // __syncthreads: the block's threads meet here
    std::mutex m; std::condition_variable cv; int count = 0, generation = 0, size;
    explicit Barrier(int n) : size(n) {}
    void wait() {
        std::unique_lock<std::mutex> lock(m);
        int g = generation;
        if (++count == size) { count = 0; generation++; cv.notify_all(); return; }
        cv.wait(lock, [&] { return g != generation; });
    }
};
static Barrier* barrier;
static void __syncthreads() { barrier->wait(); }
static double __longlong_as_double(unsigned long long v) { double d; memcpy(&d, &v, 8); return d; }
"""

DRIVER = r"""
template <class F> static void launch(long long grid, F f) {
    for (long long b = 0; b < grid; b++) {
        blockIdx.x = (unsigned)b;
        Barrier block(BLOCK);
        barrier = &block;
        std::vector<std::thread> threads;
        for (int t = 0; t < BLOCK; t++) threads.emplace_back([&, t] { threadIdx.x = (unsigned)t; f(); });
        for (auto& t : threads) t.join();
    }
}
template <class T> static std::vector<T> load(const char* path, long long n) {
    std::vector<T> v(n);
    FILE* f = fopen(path, "rb");
    if (!f || fread(v.data(), sizeof(T), n, f) != (size_t)n) { fprintf(stderr, "cannot read %s\n", path); exit(2); }
    fclose(f);
    return v;
}
static void save(const char* path, const std::vector<double>& v) {
    FILE* f = fopen(path, "wb");
    fwrite(v.data(), sizeof(double), v.size(), f);
    fclose(f);
}
int main(int argc, char** argv) {
    const char* k = argv[1];
    long long a = atoll(argv[2]), b = atoll(argv[3]), c = atoll(argv[4]);
    double eps = atof(argv[5]);
    if (!strcmp(k, "rms_norm")) {  // rows a, D b, has_w c: x w -> y
        auto x = load<double>(argv[6], a * b), w = load<double>(argv[7], b);
        std::vector<double> y(a * b);
        launch(a, [&] { refimpl_rms_norm(x.data(), w.data(), y.data(), b, eps, (int)c); });
        save(argv[8], y);
    } else if (!strcmp(k, "norm_rope")) {  // rows a, D b, heads c: x w cos sin -> y
        long long T = a / c;
        auto x = load<double>(argv[6], a * b), w = load<double>(argv[7], b);
        auto cs = load<double>(argv[8], T * b / 2), sn = load<double>(argv[9], T * b / 2);
        std::vector<double> y(a * b);
        launch(a, [&] { refimpl_norm_rope(x.data(), w.data(), cs.data(), sn.data(), y.data(), b, c, eps); });
        save(argv[10], y);
    } else {  // masked_softmax: rows a (K T G), S b, T c, G from eps: scores mask -> probabilities
        long long G = (long long)eps, T = c;
        auto x = load<double>(argv[6], a * b);
        auto mask = load<unsigned char>(argv[7], T * b);  // (numpy's bools: a byte each, as CUDA's)
        launch(a, [&] { refimpl_masked_softmax(x.data(), (const bool*)mask.data(), b, T, G); });
        save(argv[8], x);
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    where = tmp_path_factory.mktemp("kernels")
    (where / "kernels.cpp").write_text(HEADER + device_kernels.ROW_KERNELS.replace('extern "C"', "") + DRIVER)
    build = subprocess.run([CXX, "-std=c++17", "-O1", "-ffp-contract=off", "-pthread", "-Wall", "-Werror",
                            "-Wno-sign-compare", "-Wno-unused-function", str(where / "kernels.cpp"), "-o",
                            str(where / "kernels")], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]

    def run(kernel: str, sizes: tuple, scalar: float, arrays: list[np.ndarray], shape: tuple) -> np.ndarray:
        paths = []
        for i, a in enumerate(arrays):
            paths.append(str(where / f"in{i}.bin"))
            np.ascontiguousarray(a).tofile(paths[-1])
        out = str(where / "out.bin")
        done = subprocess.run([str(where / "kernels"), kernel, *map(str, sizes), repr(scalar), *paths, out],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return np.fromfile(out, dtype=np.float64).reshape(shape)
    return run


def _close(got: np.ndarray, want: np.ndarray, width: int) -> None:
    """Within the rounding a sum of ``width`` terms in another order moves a result by."""
    scale = max(1.0, float(np.max(np.abs(want[np.isfinite(want)]), initial=0.0)))
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert float(np.max(np.abs(np.nan_to_num(got) - np.nan_to_num(want)))) <= 4 * width * EPS * scale


@pytest.mark.parametrize("rows, D, weighted", [(6, 24, True), (3, 600, True), (4, 257, False)])
def test_rms_norm(emulator, rows, D, weighted):
    rng = np.random.default_rng(D)
    x, w = 3 * rng.standard_normal((rows, D)), rng.standard_normal(D)
    got = emulator("rms_norm", (rows, D, int(weighted)), 1e-6, [x, w], (rows, D))
    _close(got, ops.rms_norm(x, w if weighted else None, 1e-6), D)


@pytest.mark.parametrize("T, heads, D", [(3, 4, 16), (2, 2, 520)])
def test_norm_rope(emulator, T, heads, D):
    rng = np.random.default_rng(D)
    x, w = rng.standard_normal((T, heads, D)), rng.standard_normal(D)
    cos, sin = ops.rope_cos_sin(np.arange(40, 40 + T), 1.0 / 10000 ** (np.arange(0, D, 2) / D))
    got = emulator("norm_rope", (T * heads, D, heads), 1e-6, [x, w, cos, sin], (T, heads, D))
    _close(got, ops.norm_rope(x, cos, sin, w, 1e-6), D)


@pytest.mark.parametrize("K, T, G, S, window", [(2, 5, 2, 11, 4), (1, 3, 2, 700, None)])
def test_masked_softmax(emulator, K, T, G, S, window):
    """Sliding and causal masks over keys past a block of threads; a row whose keys are all masked is NaN in both
    (ops: -inf - -inf), and a NaN score makes its row NaN."""
    rng = np.random.default_rng(S)
    scores = 8 * rng.standard_normal((K, T, G, S))
    mask = ops.attention_mask(np.arange(S - T, S), np.arange(S), window)
    mask[0] = False  # a query that sees no key
    scores[-1, -1, -1, S - 1] = np.nan  # a NaN among the seen keys
    got = emulator("masked_softmax", (K * T * G, S, T), float(G), [scores, mask], scores.shape)
    with np.errstate(invalid="ignore"):  # (the unseeing row: -inf - -inf)
        want = ops.masked_softmax(scores.copy(), mask[None, :, None, :])
    _close(got, want, S)
    assert np.isnan(got[:, 0]).all() and np.isnan(got[-1, -1, -1]).all()
