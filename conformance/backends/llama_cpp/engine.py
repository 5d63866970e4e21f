"""llama.cpp (through llama-cpp-python's low-level C API) as an in-process conformance backend.

``LlamaCppEngine`` drives llama.cpp the way a server built on ``libllama`` does. It is an ordinary
in-process backend (``conformance.protocol.Backend``); **run it through**
``conformance.backends.llama_cpp.backend.LlamaCppBackend`` (registered as ``llama-cpp``), which
serves it from a child process: a failed ``GGML_ASSERT`` aborts the whole process (for example
llama.cpp's positional KV-sharing rule on a checkpoint whose unshared-layer prefix does not end in
``[sliding, full]``: ``llama-kv-cache.cpp: GGML_ASSERT(map_layer_ids.find(il_reuse) != ...)``), and
only a child process turns that into an error for the one case.

Opening a checkpoint
    The Hugging Face directory is converted to GGUF with the converter vendored in llama-cpp-python's
    sdist (``vendor/llama.cpp/convert_hf_to_gguf.py``, run with ``sys.executable``), ``--outtype f32``
    by default. The converter needs a ``tokenizer.json``: when the directory has none, one is made
    from ``tokenizer.model`` in a temporary copy of the directory (weights symlinked) with
    ``transformers.GemmaTokenizer.from_pretrained(dir).save_pretrained(dir)``, and its size must equal
    the config's ``vocab_size``. The GGUF is cached by content (sha256 of config.json, the
    safetensors files, the tokenizer files, the converter's sources and the outtype) under
    ``$GEMMA4_CONFORMANCE_CACHE/gguf`` (default ``~/.cache/gemma4-conformance/gguf``), so only the
    first open of a checkpoint converts. The model is loaded with ``llama_model_load_from_file``.

Serving requests (low-level API, ``llama_batch_init`` / ``llama_decode`` / ``llama_get_logits_ith``)
    Every request gets a **fresh context** (``llama_init_from_model``; a new KV cache, nothing
    survives from an earlier request) sized for it: ``n_seq_max`` = the largest sequence id + 1,
    ``n_ctx_seq`` = the longest sequence rounded up to 256 (llama.cpp pads it so; without a unified
    KV cache ``n_ctx = n_ctx_seq * n_seq_max``, each sequence its own stream), ``n_batch`` = the
    largest batch, ``n_ubatch`` = ``request.ubatch`` (else ``n_batch``: the batch is one forward).

    * ``full``: one batch, the logits flag on every token.
    * ``last``: one batch, the flag on row ``last_pos`` only (an interior row is gathered by
      llama.cpp's ``inp_out_ids`` before the last layers and the head). ``plain`` uses sequence 0;
      ``seq_id`` puts ``request.seq_id`` in the batch (``None``: sequence 0).
    * ``prefill``: each piece is one batch (one ``llama_decode``) with the flags on its rows only;
      llama.cpp splits it into micro-batches of ``n_ubatch`` itself, so micro-batches with no output
      still write K/V. Positions continue across pieces.
    * ``multi``: all sequences in **one** batch, each token tagged with its sequence id (the
      request's ids), the flag on the last token of each.
    * decode: one-token batches with the flag on, at position ``P + j``; for ``multi`` the steps
      are interleaved over the sequences (``multi_decode="interleaved"``), or one batch per step
      holding one token of every live sequence (``multi_decode="batched"``, what a server does).

    ``executed`` records the context (n_ctx, n_ctx_seq, n_seq_max, n_batch, n_ubatch, KV type, flash
    attention, library), every ``llama_decode`` call (tokens, outputs, sequence ids), and the state
    length llama.cpp reports after the prefill (``llama_memory_seq_pos_max + 1``).

Hidden states (``hidden_states``)
    A request with ``hidden`` gets a context that keeps the output of the final norm for every token
    (``llama_set_embeddings_nextn(ctx, true, masked=false)``, llama.cpp's staging API reached by its
    C++ names: ``ext``): Gemma 4's graph names that tensor ``h_nextn`` (always a graph output) and
    takes the head's input rows (``result_norm``) from it, so the graph and the logits are unchanged;
    each output row's state is ``llama_get_embeddings_nextn_ith`` of its batch index, read beside its
    logits. Not ``embeddings=true`` with pooling none (``cparams.embeddings``): that forces every token
    to be an output, which would change the rows llama.cpp computes.

Traces (``traces``)
    A request with ``trace`` (not MTP) gets a context whose graph evaluation callback (``cb_eval``) copies
    the tensors of Gemma 4's graph that are the trace points (``inp_scaled``, ``attn_post_norm-i``,
    ``ffn_post_norm-i``, ``ffn_moe_topk-i``, ``per_layer_embd_out-i``, ``l_out-i``, ``result_norm``: every point
    of ``conformance.protocol.trace``) at each batch's output rows, lined up with the logits rows; see
    ``conformance.backends.llama_cpp.trace``. Other contexts get no callback. The ``llama-cpp`` backend's
    child serves them through the subprocess protocol.

MTP (``mtp``, ``mtp_generate``; convention ``target-cache/P``)
    ``mtp.run_mtp``: the drafter checkpoint converted like the target (architecture
    ``gemma4-assistant``, without the centroid head), a context of type MTP over the target's KV cache,
    and llama.cpp's ``draft-mtp`` loop ported to Python (``common_speculative`` is not in libllama);
    see ``conformance.backends.llama_cpp.mtp``.

Input embeddings (``last_embeddings``): not claimed by default
    llama.cpp's Gemma 4 graph (``src/models/gemma4.cpp``) does not take ``batch.embd`` together with
    the token ids the per-layer embeddings (PLE) need. A batch with ``embd`` and no tokens takes the
    PLE of the padding token 0 for every position (``TAG_GEMMA4_IMG_PADDING``, meant for image
    soft tokens), and a batch that carries both uses the token path and ignores ``embd``
    (``build_inp_embd`` selects on ``ubatch.token``). ``embeddings=true`` claims the entry anyway
    and sends ``embd``-only batches (convention ``"scaled"``: the graph multiplies by ``sqrt(H)``
    only for token input): right for checkpoints without PLE, wrong by design for PLE checkpoints.

Options (``--backend-option KEY=VALUE``)
    ``kv_type``        ``"f16"`` (default, llama.cpp's default cache type) or ``"f32"``.
    ``lib``            ``"stock"`` (default: the library in the llama_cpp package), ``"exact-gelu"``
                       (``.cache/llama-cpp/exact-gelu/build/bin``, built by
                       ``scripts/build-llama-cpp.sh --exact-gelu``: ``GGML_GELU_FP16`` disabled) or
                       a directory holding ``libllama.so``. llama-cpp-python loads the library at
                       import from ``LLAMA_CPP_LIB_PATH``; in-process the engine sets it before the
                       first import, else checks that the loaded library is the one asked for.
    ``threads``        threads for llama.cpp (default 2).
    ``flash_attn``     ``false`` (default; llama.cpp's own default is "auto") or ``true``.
    ``outtype``        GGUF weight type: ``"f32"`` (default), ``"f16"``, ``"bf16"``, ``"q8_0"``.
    ``source``         the llama.cpp source tree holding ``convert_hf_to_gguf.py`` (default: env
                       ``LLAMA_CPP_SOURCE``, else the sdist tree that scripts/build-llama-cpp.sh
                       extracts: ``.cache/llama-cpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp``).
    ``cache_dir``      where GGUF files are cached (default above).
    ``swa_full``       ``true`` (default, llama.cpp's default): full-size cache for sliding layers.
    ``kv_unified``     ``false`` (default, llama.cpp's default): one KV stream per sequence.
    ``multi_decode``   ``"interleaved"`` (default) or ``"batched"`` (see above).
    ``embeddings``     ``false`` (default) or ``true`` (see above).
    ``default_profile`` override the profile chosen below.
    ``verbose``        ``false`` (default): llama.cpp's log goes to stderr at level error only.
    ``traces``         ``true`` (default): claim and serve traces (see above).

Profiles
    ``fp16-kv`` for an f16 KV cache (either library). ``fp32`` for an f32 KV cache with the exact-GELU
    library. The **stock library with an f32 KV cache is graded ``fp16-kv`` too**: stock ggml-cpu
    computes GELU through a float16 lookup table (``GGML_GELU_FP16`` in ``ggml-cpu/vec.h``), an fp16
    rounding of every MLP activation, which is the "stock llama.cpp with its fp16 GELU table" the
    ``fp16-kv`` profile describes and which ``fp32`` is calibrated to catch. ``flash_attn=true`` is
    ``fp16-kv`` whatever the cache type: ``build_attn_mha`` (src/llama-graph.cpp) casts an f32 K/V
    view to f16 before ``ggml_flash_attn_ext`` (measured: exact-GELU + f32 KV + flash attention
    fails ``fp32`` on 147 of 220 cases at max_abs 0.02-0.15, passes ``fp16-kv``). Other outtypes
    are graded by analogy and ship no expectations: ``bf16`` for f16/bf16 weights, ``q8`` for q8_0
    (measured with an f16 KV cache on the 220 claimed cases: f16 fails 1, a 26b-a4b-mini MoE
    near-tie; bf16 fails 13, MoE near-ties and e2b-mini rows; q8_0 fails 15, e2b-mini kl_mean
    0.12-0.2 > 0.1 and two decided top-1 flips).

The name shows the configuration: ``llama-cpp-f16kv``, ``llama-cpp-f32kv``,
``llama-cpp-f32kv-exact-gelu`` (plus ``-fa``, ``-<outtype>``, ``-custom-lib``, ``-swa-small``,
``-kv-unified``, ``-embd`` when set); ``expectations_file`` is
``conformance/backends/llama_cpp/expectations/<name>.json`` when that file ships.

    conformance check --backend llama-cpp --backend-option kv_type=f32 --backend-option lib=exact-gelu
    conformance check --backend conformance.backends.llama_cpp.engine:LlamaCppEngine   # in-process
"""

from __future__ import annotations

import ctypes
import itertools
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from refimpl.gguf_io import is_gguf

from ...protocol.serving import check_multi
from ...protocol.types import BackendError, Request, Response
from .context import LlamaContext
from .convert import convert_to_gguf, read_text_config
from .ext import Ext
from .library import import_llama_cpp, loaded_library, resolve_lib, resolve_source
from .mtp import check_assistant, run_mtp
from .options import (
    KV_TYPES,
    capabilities_for,
    check_options,
    config_name,
    default_profile_for,
    expectations_for,
    gguf_text_config,
)
from .trace import SOURCE as TRACE_SOURCE
from .trace import Tracer

__all__ = ["LlamaCppEngine"]

LLAMA_MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ (src/llama-cparams.h)
CTX_PAD = 256  # llama.cpp pads n_ctx and n_ctx_seq to a multiple of 256
HIDDEN_SOURCE = ("llama_get_embeddings_nextn_ith: t_h_nextn (the output of output_norm, the head's input), "
                 "llama_set_embeddings_nextn(ctx, true, masked=false)")
# ----------------------------------------------------------------------------------------------
# options


# ----------------------------------------------------------------------------------------------
# conversion to GGUF


# ----------------------------------------------------------------------------------------------
# the library


# ----------------------------------------------------------------------------------------------
# the engine


def _pad(n: int, to: int = CTX_PAD) -> int:
    return max(to, -(-n // to) * to)


class LlamaCppEngine:
    """llama.cpp in this process behind the backend protocol; see the module docstring."""

    def __init__(self, kv_type: str = "f16", lib: str = "stock", threads: int = 2, flash_attn: bool = False,
                 outtype: str = "f32", source: str | None = None, cache_dir: str | None = None,
                 swa_full: bool = True, kv_unified: bool = False, multi_decode: str = "interleaved",
                 embeddings: bool = False, default_profile: str | None = None, verbose: bool = False,
                 traces: bool = True):
        o = check_options(kv_type, lib, threads, flash_attn, outtype, swa_full, kv_unified, multi_decode,
                          embeddings, default_profile, verbose, traces)
        self.options = o
        self.lib_kind, self.lib_dir = resolve_lib(o["lib"])
        self.source_option = source
        self.cache_dir = cache_dir
        self.name = config_name(o["kv_type"], self.lib_kind, o["flash_attn"], o["outtype"], o["swa_full"],
                                o["kv_unified"], o["embeddings"])
        profile = o["default_profile"] or default_profile_for(o["kv_type"], self.lib_kind, o["outtype"],
                                                              o["flash_attn"])
        self.capabilities = capabilities_for(profile, o["embeddings"], o["traces"], o["kv_type"], o["flash_attn"],
                                             self.lib_kind)
        self.expectations_file = expectations_for(self.name)
        self.L = None
        self.model = None
        self.n_vocab = 0
        self.n_embd = 0
        self.ext: Ext | None = None
        self._hidden = False  # the request being served asks for hidden rows (Request.hidden)
        self._trace = False  # ... and for its trace (Request.trace; not for MTP requests)
        self._drafters: dict[str, tuple[Any, dict[str, Any]]] = {}  # drafter directory -> (model, GGUF info)
        self.has_ple = False
        self.gguf_info: dict[str, Any] = {}
        self._log_lines: deque[str] = deque(maxlen=60)
        self._log_cb = None

    # -- logging --------------------------------------------------------------------------------

    def _install_logger(self) -> None:
        L = self.L
        verbose = self.options["verbose"]
        lines = self._log_lines

        def cb(level, text, _user):
            try:
                msg = text.decode("utf-8", "replace") if text else ""
            except Exception:  # noqa: BLE001 - a log callback must never raise into C
                return
            if msg.strip():
                lines.append(msg.rstrip("\n"))
            if verbose or level == 4:  # GGML_LOG_LEVEL_ERROR
                sys.stderr.write(msg)
                sys.stderr.flush()

        self._log_cb = L.llama_log_callback(cb)
        L.llama_log_set(self._log_cb, ctypes.c_void_p(0))

    def _log_tail(self, n: int = 8) -> str:
        return " | ".join(list(self._log_lines)[-n:])

    # -- protocol -------------------------------------------------------------------------------

    def open(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        source = resolve_source(self.source_option)
        L = self.L = import_llama_cpp(self.lib_kind, self.lib_dir)
        self._install_logger()
        L.llama_backend_init()
        self.ext = Ext(L)
        log = (lambda m: sys.stderr.write(m + "\n")) if self.options["verbose"] else None
        if model_dir.is_file() and is_gguf(model_dir):  # a GGUF file as the checkpoint: loaded as it is
            path, info, cfg = model_dir, {"gguf": str(model_dir), "given": True}, gguf_text_config(model_dir)
        else:
            path, info = convert_to_gguf(model_dir, source, self.options["outtype"], self.cache_dir, log=log)
            cfg = read_text_config(model_dir)
        mparams = L.llama_model_default_params()
        t0 = time.monotonic()
        model = L.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise BackendError(f"llama-cpp backend: llama_model_load_from_file({path}) failed: {self._log_tail()}")
        self.model = model
        vocab = L.llama_model_get_vocab(model)
        self.n_vocab = int(L.llama_vocab_n_tokens(vocab))
        self.n_embd = int(L.llama_model_n_embd(model))
        if cfg.get("vocab_size") is not None and self.n_vocab != cfg["vocab_size"]:
            self.close()
            raise BackendError(f"llama-cpp backend: the GGUF has {self.n_vocab} tokens, config vocab_size is "
                               f"{cfg['vocab_size']}")
        self.has_ple = bool(cfg.get("hidden_size_per_layer_input") or 0)
        self.gguf_info = {**info, "load_s": round(time.monotonic() - t0, 3)}
        self.library = {"lib": self.lib_kind, "libllama": loaded_library("libllama"),
                        "libggml-cpu": loaded_library("libggml-cpu"),
                        "llama_cpp_python": getattr(L, "__version__", None)}

    def close(self) -> None:
        if self.L is not None:
            for model, _ in self._drafters.values():
                self.L.llama_model_free(model)
        self._drafters = {}
        if self.model is not None and self.L is not None:
            self.L.llama_model_free(self.model)
        self.model = None

    def drafter_model(self, path: str | None):
        """The assistant checkpoint at ``path`` as a llama_model (converted to GGUF like the target; loaded
        once per directory)."""
        if not path:
            raise ValueError("llama-cpp backend: an mtp request needs the drafter's directory (request.drafter)")
        if path not in self._drafters:
            d = Path(path)
            check_assistant(d)
            gguf, info = convert_to_gguf(d, resolve_source(self.source_option), self.options["outtype"],
                                         self.cache_dir)
            model = self.L.llama_model_load_from_file(str(gguf).encode(), self.L.llama_model_default_params())
            if not model:
                raise BackendError(f"llama-cpp backend: llama_model_load_from_file({gguf}) failed for the drafter "
                                   f"{d}: {self._log_tail()}")
            self._drafters[path] = (model, {k: info.get(k) for k in ("key", "outtype", "cached")})
        return self._drafters[path][0]

    def drafter_info(self, path: str) -> dict[str, Any]:
        return {"dir": path, "gguf": self._drafters[path][1]}

    def run(self, request: Request) -> Response:
        if self.model is None:
            raise RuntimeError("llama-cpp backend: run() called before open()")
        handler = {"full": self._full, "last": self._last, "prefill": self._prefill, "multi": self._multi,
                   "mtp": lambda r: run_mtp(self, r)}[request.kind]
        self._hidden = bool(request.hidden)
        self._trace = bool(request.trace) and self.capabilities.traces and request.kind != "mtp"
        return handler(request)

    # -- context and batches --------------------------------------------------------------------

    def _new_context(self, n_seq_max: int, longest: int, n_batch: int, n_ubatch: int | None,
                     total: int | None = None, hidden: bool | None = None) -> LlamaContext:
        """A context for one request: ``longest`` tokens per sequence, ``total`` over all sequences
        (a unified KV cache holds them all in one stream), batches of up to ``n_batch`` tokens; keeping the
        final-norm states when ``hidden`` (default: when the request asks for them), tracing when the request asks
        for a trace (``trace.Tracer`` as its ``cb_eval``; no callback otherwise)."""
        L = self.L
        o = self.options
        if not 1 <= n_seq_max <= LLAMA_MAX_SEQ:
            raise ValueError(f"llama-cpp backend: sequence ids must lie in [0, {LLAMA_MAX_SEQ}), "
                             f"needs n_seq_max {n_seq_max}")
        n_ctx_seq = _pad(longest)
        p = L.llama_context_default_params()
        p.n_ctx = _pad(max(longest, total or 0)) if o["kv_unified"] else n_ctx_seq * n_seq_max
        p.n_batch = max(1, n_batch)
        p.n_ubatch = max(1, min(n_ubatch or n_batch, p.n_batch))
        p.n_seq_max = n_seq_max
        p.n_threads = p.n_threads_batch = o["threads"]
        p.type_k = p.type_v = KV_TYPES[o["kv_type"]]
        p.flash_attn_type = 1 if o["flash_attn"] else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED
        p.swa_full = o["swa_full"]
        p.kv_unified = o["kv_unified"]
        p.no_perf = True
        tracer = Tracer(L) if self._trace else None
        if tracer is not None:
            p.cb_eval = tracer.callback
        ctx = L.llama_init_from_model(self.model, p)
        if not ctx:
            raise RuntimeError(f"llama-cpp backend: llama_init_from_model failed: {self._log_tail()}")
        c = LlamaContext(self, ctx, hidden=self._hidden if hidden is None else hidden, tracer=tracer)
        c.type_kv = p.type_k
        c.info = {"n_ctx": int(L.llama_n_ctx(ctx)), "n_ctx_seq": int(L.llama_n_ctx_seq(ctx)),
                  "n_seq_max": int(L.llama_n_seq_max(ctx)), "n_batch": int(L.llama_n_batch(ctx)),
                  "n_ubatch": int(L.llama_n_ubatch(ctx))}
        return c

    def _executed(self, path: str, c: LlamaContext, **extra) -> dict[str, Any]:
        o = self.options
        return {"path": path, "engine": "llama.cpp", "dtype": "float32", "kv_type": o["kv_type"],
                "flash_attn": o["flash_attn"], "swa_full": o["swa_full"], "kv_unified": o["kv_unified"],
                "threads": o["threads"], "library": self.library,
                "gguf": {k: self.gguf_info.get(k) for k in ("key", "outtype", "cached")},
                "fresh_state": True, "state": "a new llama_context (and KV cache) for this request",
                "context": c.info, "decode_calls": c.calls,
                **({"hidden": HIDDEN_SOURCE} if c.hidden is not None else {}),
                **({"trace": TRACE_SOURCE} if c.tracer is not None else {}), **extra}

    # -- request kinds --------------------------------------------------------------------------

    @staticmethod
    def _check_tokens(tokens: Sequence[int], what: str) -> None:
        if len(tokens) == 0:
            raise ValueError(f"llama-cpp backend: {what} has no tokens")

    def _full(self, request: Request) -> Response:
        T = len(request.tokens)
        self._check_tokens(request.tokens, "full request")
        with self._new_context(1, T + len(request.decode), T, None) as c:
            rows = c.decode_tokens(request.tokens, 0, 0, range(T))
            hidden, trace = c.take_hidden(), c.take_trace()
            state = c.seq_len(0)
            dec = c.decode_steps(0, request.decode, T)
            return Response(rows, dec, self._executed("full", c, rows=T, state_len_after_prefill=state,
                                                      decode_steps=len(request.decode)),
                            hidden=hidden, decode_hidden=c.take_hidden() if dec is not None else None,
                            trace=trace, decode_trace=c.take_trace() if dec is not None else None)

    def _last(self, request: Request) -> Response:
        T = len(request.tokens)
        self._check_tokens(request.tokens, "last request")
        if not 0 <= request.last_pos < T:
            raise ValueError(f"llama-cpp backend: last_pos {request.last_pos} is outside the {T} tokens of the call")
        seq = 0 if request.entry == "plain" or request.seq_id is None else int(request.seq_id)
        if seq < 0:
            raise ValueError(f"llama-cpp backend: seq_id must be >= 0, got {seq}")
        with self._new_context(seq + 1, T + len(request.decode), T, None) as c:
            if request.entry == "embeddings":
                if not self.options["embeddings"]:
                    raise ValueError("llama-cpp backend: entry 'embeddings' is not claimed (option embeddings=false)")
                if request.embeddings is None:
                    raise ValueError("llama-cpp backend: entry 'embeddings' without embeddings")
                emb = np.asarray(request.embeddings, dtype=np.float32)
                if emb.shape != (T, self.n_embd):
                    raise ValueError(f"llama-cpp backend: embeddings shape {emb.shape}, expected ({T}, {self.n_embd})")
                rows = c.decode_embeddings(emb, seq, 0, [request.last_pos])
            else:
                rows = c.decode_tokens(request.tokens, seq, 0, [request.last_pos])
            hidden, trace = c.take_hidden(), c.take_trace()
            state = c.seq_len(seq)
            dec = c.decode_steps(seq, request.decode, T)
            extra = {}
            if request.entry == "embeddings":
                extra["embeddings_input"] = "batch.embd only (no token ids)" + (
                    "; llama.cpp takes the per-layer embeddings of token 0 for every position" if self.has_ple else "")
            return Response(rows, dec, self._executed(
                "last", c, entry=request.entry, seq_id=seq, last_pos=request.last_pos, output_rows=[request.last_pos],
                state_len_after_prefill=state, decode_steps=len(request.decode), **extra),
                hidden=hidden, decode_hidden=c.take_hidden() if dec is not None else None,
                trace=trace, decode_trace=c.take_trace() if dec is not None else None)

    def _prefill(self, request: Request) -> Response:
        if not request.pieces:
            raise ValueError("llama-cpp backend: prefill request has no pieces")
        if request.ubatch is not None and request.ubatch < 1:
            raise ValueError(f"llama-cpp backend: ubatch must be >= 1, got {request.ubatch}")
        total = sum(len(p.tokens) for p in request.pieces)
        longest_piece = max(len(p.tokens) for p in request.pieces)
        out: list[np.ndarray] = []
        pieces_done = []
        with self._new_context(1, total + len(request.decode), longest_piece, request.ubatch) as c:
            pos = 0
            for i, piece in enumerate(request.pieces):
                T = len(piece.tokens)
                self._check_tokens(piece.tokens, f"piece {i}")
                rows = [int(r) for r in piece.rows]
                if any(not 0 <= r < T for r in rows) or any(b <= a for a, b in itertools.pairwise(rows)):
                    raise ValueError(f"llama-cpp backend: piece {i} rows {rows} must be increasing within [0, {T})")
                out.append(c.decode_tokens(piece.tokens, 0, pos, rows))
                ub = c.info["n_ubatch"]
                pieces_done.append({"tokens": T, "rows": rows, "pos0": pos,
                                    "ubatches": [min(ub, T - s) for s in range(0, T, ub)]})
                pos += T
            hidden, trace = c.take_hidden(), c.take_trace()
            state = c.seq_len(0)
            dec = c.decode_steps(0, request.decode, pos)
            logits = np.concatenate(out) if out else np.empty((0, self.n_vocab), dtype=np.float32)
            return Response(logits, dec, self._executed(
                "prefill", c, ubatch=request.ubatch, pieces=pieces_done,
                ubatches=[u for p in pieces_done for u in p["ubatches"]],
                state_len_after_prefill=state, decode_steps=len(request.decode)),
                hidden=hidden, decode_hidden=c.take_hidden() if dec is not None else None,
                trace=trace, decode_trace=c.take_trace() if dec is not None else None)

    def _multi(self, request: Request) -> Response:
        seq_ids, decode = check_multi(request, "llama-cpp backend")
        seq_ids = tuple(int(s) for s in seq_ids)
        if min(seq_ids) < 0:
            raise ValueError(f"llama-cpp backend: seq_ids must be >= 0, got {list(seq_ids)}")
        lens = [len(s) for s in request.sequences]
        longest = max(L_ + (len(decode[i]) if decode else 0) for i, L_ in enumerate(lens))
        total = sum(lens) + sum(len(d) for d in decode)
        with self._new_context(max(seq_ids) + 1, longest, sum(lens), None, total) as c:
            logits = c.decode_multi(request.sequences, seq_ids)
            hidden, trace = c.take_hidden(), c.take_trace()
            states = [c.seq_len(s) for s in seq_ids]
            decode_logits = decode_hidden = decode_trace = None
            if decode:
                decode_logits, decode_hidden, decode_trace = c.decode_multi_steps(seq_ids, decode, lens,
                                                                                  self.options["multi_decode"])
            return Response(logits, decode_logits, self._executed(
                "multi", c, seq_ids=list(seq_ids), one_batch=True, multi_decode=self.options["multi_decode"],
                state_len_after_prefill=states, decode_steps=[len(d) for d in decode] if decode else 0),
                hidden=hidden, decode_hidden=decode_hidden, trace=trace, decode_trace=decode_trace)


