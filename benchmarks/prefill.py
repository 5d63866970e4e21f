"""Oracle prefill at real size: speed against the float64 matmul roofline and transformers, and peak memory.

    python benchmarks/prefill.py --model DIR [--tokens 512] [--rows last|all] [--repeat 2]
                                 [--transformers exact|plain|off] [--cached on|off] [--baseline DIR]
                                 [--device cpu|cuda] [--json OUT.json]

Every part runs in a fresh child process (so each peak resident set is its own, ``ru_maxrss``), one
after the other, on the same checkpoint and the same prompt (``--tokens`` ids drawn from
``numpy default_rng(0)`` over the synthetic tokenizer's ordinary range):

- ``oracle``: ``refimpl.model.Gemma4(DIR).forward(ids, rows=...)`` in float64, best of ``--repeat``
  (the first run also pulls the checkpoint into the page cache; it is reported separately).
- ``oracle-cached`` (``--cached on``): the same with ``weight_cache="all"``: the first run decodes
  every projection weight and the head into memory (float64), the later ones only multiply: the
  oracle's steady state, comparable with transformers once it holds its float64 weights; skipped when
  those weights would not fit in the memory available.
- ``roofline``: the float64 matrix multiplies of the same forward, with the same shapes, on weights
  decoded beforehand (decoding not timed): every projection ``x [T, in] @ W[out, in]^T`` of every
  layer, the two attention products per layer (``[K, T G, D] @ [K, D, S]`` and back, a block of query
  rows at a time over the span of keys they see, as ``refimpl.schedule.attention`` multiplies), the PLE
  model projection, and the head over the requested rows. The KV-shared layers run on the requested
  rows only (T -> R), as the oracle and transformers both do, and so does the last layer that makes
  K/V, but for its K and V projections (the oracle's pruning; transformers runs that layer on every
  row). Their summed best-of-``--repeat`` time is what a forward made of nothing but matmuls would take; the ratio
  roofline / oracle is the fraction
  of the matmul rate the oracle reaches.
- ``baseline`` (``--baseline DIR``): the ``oracle`` part again with the refimpl of another checkout
  (e.g. ``git worktree add /tmp/before HEAD~3``): before and after a change, side by side in one run.
- ``transformers``: ``Gemma4ForCausalLM`` (``Gemma4UnifiedForCausalLM`` for a Gemma 4 Unified checkpoint) in float64
(``exact``: with the float32 spots patched as in
  tests/hf_reference.py, the implementation the tests agree with at 1e-12; ``plain``: as shipped),
  eager attention, ``logits_to_keep`` for the requested rows, best of ``--repeat``; skipped, with the
  reason, when its float64 weights would not fit in the memory available. Its logits are compared with
  the oracle's (max |difference|).

``--device cuda`` (a CUDA machine with CuPy): the oracle, the cached oracle and the roofline run on the GPU
(``Gemma4(DIR, device="cuda")``, CuPy's float64 GEMM; every timed call ends with the device synchronised),
transformers on the same GPU (the model moved there, ``torch.cuda``), and ``oracle-cpu`` is the streamed oracle
on the CPU cores beside them; each GPU part reports its peak GPU memory (CuPy's pool, torch's reserved bytes).

Threads: NumPy (OpenBLAS), the oracle's weight decoding and torch all use every core this process may
run on (so ``taskset -c 0,1 python benchmarks/prefill.py ...`` measures two cores).
Prints a Markdown table; ``--json`` keeps every number and the machine description.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the oracle part of --baseline runs with another checkout's refimpl (BENCH_REFIMPL_ROOT)
sys.path.insert(0, os.environ.get("BENCH_REFIMPL_ROOT") or str(ROOT))

import refimpl  # noqa: E402,F401  (first: it sets OpenBLAS's thread timeout before NumPy loads OpenBLAS)

# isort: split
import numpy as np  # noqa: E402 - after sys.path and refimpl


def prompt_ids(tokens: int) -> np.ndarray:
    """The benchmark prompt: bos, then ids in [5, 512) (the synthetic tokenizer's pieces)."""
    ids = np.random.default_rng(0).integers(5, 512, tokens)
    ids[0] = 2
    return ids


def best_of(fn, repeat: int, warm_up: bool = False) -> float:
    """The shortest of ``repeat`` timed calls of ``fn`` (after one untimed call with ``warm_up``)."""
    if warm_up:
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def cores() -> int:
    """Cores this process may run on (taskset / cgroup affinity), the thread count of every part."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def rows_index(rows: str, T: int) -> np.ndarray:
    return np.array([T - 1]) if rows == "last" else np.arange(T)


# ----------------------------------------------------------------------------------------------
# parts (each runs in its own process)


def gpu_peak_gib(device: str) -> dict:
    """The GPU memory a CuPy part holds at its end: the pool only grows (freed blocks stay in it), so its total
    is the most the part ever held."""
    if device == "cpu":
        return {}
    import cupy

    return {"gpu_peak_gib": cupy.get_default_memory_pool().total_bytes() / 2**30,
            "gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()}


def synchronise(device: str) -> None:
    if device != "cpu":
        import cupy

        cupy.cuda.Device().synchronize()


def part_oracle(model: str, tokens: int, rows: str, repeat: int, weight_cache: str = "0", device: str = "cpu") -> dict:
    from refimpl.model import Gemma4

    ids = prompt_ids(tokens)
    m = Gemma4(model, weight_cache=weight_cache, device=device)
    times, logits = [], None
    for _ in range(repeat + 1):
        t = time.perf_counter()
        logits = m.forward(ids, rows=rows)
        times.append(time.perf_counter() - t)
    np.save(os.environ["BENCH_LOGITS"], logits)
    return {"first_s": times[0], "best_s": min(times[1:]), "times_s": times, "peak_rss_gib": peak_rss_gib(),
            "weight_cache_gib": m.weights.cache_bytes / 2**30, "device": device, **gpu_peak_gib(device)}


def cacheable_gib(model: str) -> float:
    """Float64 size of what ``weight_cache="all"`` holds: every projection weight and the head."""
    from refimpl.config import load_config
    from refimpl.weights import expected_tensors

    cfg = load_config(model)
    skip = ("embed_tokens_per_layer.weight",) + (() if cfg.tie_word_embeddings else ("embed_tokens.weight",))
    values = sum(int(np.prod(s)) for n, s in expected_tensors(cfg).items()
                 if len(s) == 2 and not n.endswith(skip) and "experts." not in n)
    if not cfg.tie_word_embeddings:
        values += cfg.vocab_size * cfg.hidden_size
    return values * 8 / 2**30


def matmul_plan(cfg):
    """Per layer, the names of the weights of every projection it runs."""
    for layer in cfg.layers:
        p = f"layers.{layer.index}."
        names = ["self_attn.q_proj.weight"]
        if layer.owns_kv:
            names.append("self_attn.k_proj.weight")
            if not layer.k_eq_v:
                names.append("self_attn.v_proj.weight")
        names += ["self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
        if cfg.has_ple:
            names += ["per_layer_input_gate.weight", "per_layer_projection.weight"]
        yield layer, [p + n for n in names]


def part_roofline(model: str, tokens: int, rows: str, repeat: int, device: str = "cpu") -> dict:
    from refimpl.model import HEAD_CHUNK, Gemma4
    from refimpl.ops import attention_mask
    from refimpl.schedule import ATTENTION_BLOCK, key_span

    m = Gemma4(model, device=device)
    cfg, w, xp = m.cfg, m.weights, m.xp
    if cfg.enable_moe_block:
        raise SystemExit("the roofline part covers dense models (E2B, E4B, 31B shapes); MoE routing is data-dependent")
    T = tokens
    R = len(rows_index(rows, T))
    host = np.random.default_rng(1)

    def normal(shape):  # standard normal values where the model's arrays live
        return xp.asarray(host.standard_normal(shape))

    def best(fn) -> float:  # on the GPU: the product and the device synchronised, warmed up once
        return best_of(lambda: (fn(), synchronise(device)), repeat, warm_up=device != "cpu")

    total_s, flops = 0.0, 0
    if cfg.has_ple:
        W = w["per_layer_model_projection.weight"]
        x = normal((T, W.shape[1]))
        total_s += best(lambda x=x, W=W: x @ W.T)
        flops += 2 * T * W.size
    for layer, names in matmul_plan(cfg):
        # rows this layer computes: every token up to the last layer that makes K/V, whose keys and values
        # are of every token and the rest of the layer of the requested rows only; then those rows
        Q = T if layer.index < cfg.first_shared_layer - 1 else R
        for name in names:
            W = w[name]  # decoded now, not timed
            x = normal((T if name.endswith(("k_proj.weight", "v_proj.weight")) else Q, W.shape[1]))
            total_s += best(lambda x=x, W=W: x @ W.T)
            flops += 2 * x.shape[0] * W.size
            del W
        N, D = cfg.num_attention_heads, layer.head_dim
        K = layer.num_kv_heads
        S = T  # a prefill from an empty cache attends over its own T keys
        q = normal((K, Q * (N // K), D))
        kt = normal((K, D, S))
        v = normal((K, S, D))
        # as ``ops.attention`` multiplies: blocks of query rows, each over the span of keys its rows see
        mask = attention_mask(np.arange(T) if Q == T else rows_index(rows, T), np.arange(S),
                              cfg.sliding_window if layer.is_sliding else None)
        # (on the GPU, ``schedule.attention`` steps aside: one product over every query row)
        unit = max(1, ATTENTION_BLOCK // (N * S)) if device == "cpu" else Q
        for a in range(0, Q, unit):
            b = min(a + unit, Q)
            lo, hi = key_span(mask[a:b])
            qb, pb = q[:, a * (N // K):b * (N // K)], normal((K, (b - a) * (N // K), hi - lo))
            total_s += best(lambda qb=qb, kt=kt, lo=lo, hi=hi: qb @ kt[:, :, lo:hi]) + \
                best(lambda pb=pb, v=v, lo=lo, hi=hi: pb @ v[:, lo:hi])
            flops += 2 * (2 * N * (b - a) * (hi - lo) * D)
    y = normal((R, cfg.hidden_size))
    head_s = 0.0
    for start in range(0, cfg.vocab_size, HEAD_CHUNK):
        E = xp.asarray(w.head_rows(start, min(start + HEAD_CHUNK, cfg.vocab_size)))
        head_s += best(lambda E=E: y @ E.T)
        flops += 2 * R * E.size
    total_s += head_s
    return {"matmul_s": total_s, "flops": flops, "gflops_per_s": flops / total_s / 1e9, "peak_rss_gib": peak_rss_gib(),
            "device": device, **gpu_peak_gib(device)}


def part_transformers(model: str, tokens: int, rows: str, repeat: int, flavour: str, device: str = "cpu") -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from refimpl.unified import is_unified

    torch.set_num_threads(cores())
    t = time.perf_counter()
    if is_unified(model):  # Gemma 4 Unified: Gemma4Unified{ForCausalLM,ForConditionalGeneration}
        from hf_unified_reference import recompute_float64_buffers
        from hf_unified_reference import unified_float64_exact as float64_exact

        from conformance.backends.transformers.loading import load_gemma4_unified
        hf = load_gemma4_unified(model, torch.float64)
        if flavour == "exact":
            recompute_float64_buffers(hf)
    else:
        from hf_reference import float64_exact, load_hf_causal_lm
        hf = load_hf_causal_lm(model, "float64", exact=flavour == "exact")
    hf = hf.to(device)
    load_s = time.perf_counter() - t
    ids = torch.tensor([prompt_ids(tokens).tolist()], device=device)
    keep = 1 if rows == "last" else 0  # 0 = every row
    times, logits = [], None
    ctx = float64_exact if flavour == "exact" else __import__("contextlib").nullcontext
    for _ in range(repeat + 1):
        t = time.perf_counter()
        with torch.inference_mode(), ctx():
            logits = hf(input_ids=ids, use_cache=False, logits_to_keep=keep).logits[0]
            if device != "cpu":
                torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    host = logits.cpu().numpy()  # (the oracle's forward returns its logits on the host: this copy is in its time)
    to_host_s = time.perf_counter() - t
    np.save(os.environ["BENCH_LOGITS"], host)
    gpu = {} if device == "cpu" else {"gpu_peak_gib": torch.cuda.max_memory_reserved() / 2**30,
                                      "gpu": torch.cuda.get_device_name(), "logits_to_host_s": to_host_s}
    return {"load_s": load_s, "first_s": times[0], "best_s": min(times[1:]), "times_s": times,
            "peak_rss_gib": peak_rss_gib(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "device": device, **gpu}


# ----------------------------------------------------------------------------------------------
# the driver


def run_here(args) -> dict:
    """The part ``--part`` names, in this process."""
    common = (args.model, args.tokens, args.rows, args.repeat)
    if args.part == "oracle":
        return part_oracle(*common, device=args.device)
    if args.part == "oracle-cpu":
        return part_oracle(*common, device="cpu")
    if args.part == "oracle-cached":
        return part_oracle(*common, weight_cache="all", device=args.device)
    if args.part == "roofline":
        return part_roofline(*common, device=args.device)
    return part_transformers(*common, args.transformers, device=args.device)


def run_part(part: str, args, extra: list[str], logits_path: Path | None = None, root: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--model", args.model, "--tokens", str(args.tokens), "--rows", args.rows,
           "--repeat", str(args.repeat), "--device", args.device, "--part", part, *extra]
    env = dict(os.environ, PYTHONPATH=(root or str(ROOT)) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("BENCH_REFIMPL_ROOT", None)
    if root is not None:
        env["BENCH_REFIMPL_ROOT"] = root
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, str(cores()))  # OpenBLAS may count the machine's cores, not this process's
    if logits_path is not None:
        env["BENCH_LOGITS"] = str(logits_path)
    print(f"  running {part} ...", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["exit " + str(done.returncode)])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def checkpoint_parameters(model: str) -> tuple[int, object]:
    from refimpl.config import load_config
    from refimpl.weights import expected_tensors

    cfg = load_config(model)
    return sum(int(np.prod(s)) for s in expected_tensors(cfg).values()), cfg


def mem_available_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("inf")


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    blas = ""
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]  # type: ignore[index]
    except Exception:  # noqa: BLE001 - informational only
        pass
    memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return {"cpu": cpu, "cores": cores(), "machine_cores": os.cpu_count(), "memory_gib": memory_gib,
            "python": platform.python_version(), "numpy": np.__version__, "blas": blas, "platform": platform.platform(),
            "openblas_thread_timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (e.g. from refimpl synth --preset e2b)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rows", choices=("last", "all"), default="last")
    ap.add_argument("--repeat", type=int, default=2, help="timed runs per part (best is reported)")
    ap.add_argument("--transformers", choices=("exact", "plain", "off"), default="exact")
    ap.add_argument("--cached", choices=("on", "off"), default="on",
                    help="also time the oracle with every weight decoded once and kept (weight_cache='all')")
    ap.add_argument("--baseline", metavar="DIR", help="also time the oracle of another checkout (its refimpl/)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the oracle, the roofline and transformers run (cuda: CuPy and torch on the GPU, and "
                         "the streamed oracle on the CPU beside them)")
    ap.add_argument("--json", metavar="OUT", help="write every number here")
    ap.add_argument("--part", choices=("oracle", "oracle-cpu", "oracle-cached", "roofline", "transformers"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not Path(args.model, "config.json").is_file():
        ap.error(f"--model: {args.model} is not a checkpoint directory (no config.json)")
    if args.tokens < 1 or args.repeat < 1:
        ap.error("--tokens and --repeat must be at least 1")
    if args.baseline is not None and not Path(args.baseline, "refimpl", "model.py").is_file():
        ap.error(f"--baseline: {args.baseline} is not a checkout of this project (no refimpl/model.py)")

    if args.part is not None:
        print(json.dumps(run_here(args)))
        return 0

    import tempfile

    params, cfg = checkpoint_parameters(args.model)
    result = {"command": " ".join(["python", "benchmarks/prefill.py", *(argv if argv is not None else sys.argv[1:])]),
              "machine": machine(), "model": str(Path(args.model).resolve()), "parameters": params,
              "layers": cfg.num_hidden_layers, "tokens": args.tokens, "rows": args.rows, "repeat": args.repeat}
    with tempfile.TemporaryDirectory() as tmp:
        ours = Path(tmp, "oracle.npy")

        def beside(key: str, part: str, extra: tuple[str, ...] = (), root: str | None = None) -> dict:
            """Run ``part`` as ``key``; its logits' max |difference| from the oracle's when both ran."""
            theirs = Path(tmp, f"{key}.npy")
            got = run_part(part, args, list(extra), theirs, root=root)
            if "error" not in got and ours.exists():
                got["max_abs_diff_vs_oracle"] = float(np.max(np.abs(np.load(ours) - np.load(theirs))))
            return got

        result["oracle"] = run_part("oracle", args, [], ours)
        if args.device != "cpu":
            result["oracle_cpu"] = beside("oracle_cpu", "oracle-cpu")
        if args.baseline is not None:
            result["baseline"] = beside("baseline", "oracle", root=str(Path(args.baseline).resolve()))
            result["baseline"]["checkout"] = str(Path(args.baseline).resolve())
        result["roofline"] = run_part("roofline", args, [])
        if args.cached == "on":
            need, avail = cacheable_gib(args.model) * 1.1, mem_available_gib()
            if need > avail and args.device == "cpu":
                result["oracle_cached"] = {"skipped": f"the decoded weights need about {need:.1f} GiB, {avail:.1f} GiB "
                                                      "available"}
            else:
                result["oracle_cached"] = beside("oracle_cached", "oracle-cached")
        if args.transformers != "off":
            need = params * 8 / 2**30 * 1.15  # float64 weights plus loading slack
            avail = mem_available_gib()
            if need > avail:
                result["transformers"] = {"skipped": f"float64 weights need about {need:.1f} GiB, {avail:.1f} GiB "
                                                     "available"}
            else:
                result["transformers"] = beside("transformers", "transformers", ("--transformers", args.transformers))
                if "error" not in result["transformers"]:
                    result["transformers"]["flavour"] = args.transformers
    o, r, h = result["oracle"], result["roofline"], result.get("transformers", {})
    if "best_s" in o and "matmul_s" in r:
        result["oracle_fraction_of_roofline"] = r["matmul_s"] / o["best_s"]
        result["oracle_gflops_per_s"] = r["flops"] / o["best_s"] / 1e9
    if "best_s" in o and "best_s" in h:
        result["transformers_over_oracle"] = h["best_s"] / o["best_s"]
    b = result.get("baseline", {})
    if "best_s" in b and "matmul_s" in r:
        result["baseline_fraction_of_roofline"] = r["matmul_s"] / b["best_s"]
    p = result.get("oracle_cpu", {})
    if "best_s" in p and "matmul_s" in r:
        result["oracle_cpu_fraction_of_roofline"] = r["matmul_s"] / p["best_s"]
    c = result.get("oracle_cached", {})
    if "best_s" in c and "matmul_s" in r:
        result["oracle_cached_fraction_of_roofline"] = r["matmul_s"] / c["best_s"]
    if "best_s" in c and "best_s" in h:
        result["transformers_over_oracle_cached"] = h["best_s"] / c["best_s"]
    result["device"] = args.device
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(report(result))
    return 0


def report(r: dict) -> str:
    o, f, h = r["oracle"], r["roofline"], r.get("transformers", {})

    def sec(x: float) -> str:  # GPU parts take tens of milliseconds
        return f"{x:.3f}" if x < 1 else f"{x:.2f}"

    def gpu(part: dict) -> str:
        return f"; {part['gpu']}, GPU peak {part['gpu_peak_gib']:.1f} GiB" if "gpu_peak_gib" in part else ""

    lines = [f"{Path(r['model']).name}: {r['parameters'] / 1e9:.2f} B parameters, {r['layers']} layers, "
             f"{r['tokens']} tokens, rows {r['rows']}; {r['machine']['cpu']}, {r['machine']['cores']} cores"
             + (f"; device {r['device']}" if r.get("device", "cpu") != "cpu" else ""),
             "", "| part | time (s) | GFLOP/s | peak RSS (GiB) | note |", "|---|---|---|---|---|"]
    if "best_s" in o:
        lines.append(f"| oracle float64 | {sec(o['best_s'])} | {r.get('oracle_gflops_per_s', float('nan')):.1f} | "
                     f"{o['peak_rss_gib']:.2f} | first run {o['first_s']:.2f} s; "
                     f"{100 * r.get('oracle_fraction_of_roofline', float('nan')):.0f}% of the roofline{gpu(o)} |")
    else:
        lines.append(f"| oracle float64 | - | - | - | {o.get('error')} |")
    def other_oracle(key: str, label: str, first: str, versus: str) -> None:  # the baseline, the cached oracle
        p = r.get(key, {})
        if "best_s" in p:
            lines.append(f"| {label} | {sec(p['best_s'])} | {f.get('flops', 0) / p['best_s'] / 1e9:.1f} | "
                         f"{p['peak_rss_gib']:.2f} | {first} {p['first_s']:.2f} s; "
                         f"{100 * r.get(key + '_fraction_of_roofline', float('nan')):.0f}% of the roofline; "
                         f"max |logit diff| vs {versus} {p['max_abs_diff_vs_oracle']:.1e}{gpu(p)} |")
        elif p:
            lines.append(f"| {label.split(' (')[0]} | - | - | - | {p.get('skipped') or p.get('error')} |")

    if "oracle_cpu" in r:
        other_oracle("oracle_cpu", f"oracle float64, CPU ({r['machine']['cores']} cores)", "first run", "GPU oracle")
    b = r.get("baseline", {})
    other_oracle("baseline", f"oracle float64, baseline ({Path(b.get('checkout', '')).name})", "first run", "oracle")
    other_oracle("oracle_cached", "oracle float64, weight cache", "first run (decodes into the cache)", "streamed")
    if "matmul_s" in f:
        lines.append(f"| roofline (matmuls only) | {sec(f['matmul_s'])} | {f['gflops_per_s']:.1f} | "
                     f"{f['peak_rss_gib']:.2f} | {f['flops'] / 1e12:.2f} TFLOP{gpu(f)} |")
    else:
        lines.append(f"| roofline | - | - | - | {f.get('error')} |")
    if "best_s" in h:
        lines.append(f"| transformers float64 ({h['flavour']}) | {sec(h['best_s'])} | "
                     f"{f.get('flops', 0) / h['best_s'] / 1e9:.1f} | {h['peak_rss_gib']:.2f} | "
                     f"{r['transformers_over_oracle']:.2f}x the oracle's time"
                     + (f", {r['transformers_over_oracle_cached']:.2f}x the cached "
                        "oracle's" if "transformers_over_oracle_cached" in r else "")
                     + f"; max |logit diff| vs oracle "
                     f"{h['max_abs_diff_vs_oracle']:.1e}; load {h['load_s']:.1f} s"
                     + (f"; its logits to the host after: {sec(h['logits_to_host_s'])} s" if "logits_to_host_s" in h
                        else "") + f"{gpu(h)} |")
    elif h:
        lines.append(f"| transformers float64 | - | - | - | {h.get('skipped') or h.get('error')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
