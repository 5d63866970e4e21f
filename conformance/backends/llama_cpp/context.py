"""One llama.cpp context of a request (``LlamaCppEngine._new_context``): its batches, decode calls, logits and
hidden states read back, and the trace; freed when the request is done."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...protocol.trace import trace_rows
from .options import KV_TYPES
from .trace import Tracer

__all__ = ["LlamaContext"]


class LlamaContext:
    """One llama_context for one request; freed on exit.

    ``hidden``: the context keeps every token's final-norm state (``llama_set_embeddings_nextn(ctx, true,
    false)``: ``t_h_nextn``, the LM head's input, with the graph unchanged; see ``ext``), and every batch
    collects the rows of its outputs beside their logits, for ``take_hidden``.

    ``tracer``: the ``trace.Tracer`` the context was made with (its ``cb_eval``); every batch then collects the
    trace of its outputs beside their logits, for ``take_trace``."""

    def __init__(self, engine: Any, ctx, hidden: bool = False, tracer: Tracer | None = None):
        self.e = engine
        self.L = engine.L
        self.ctx = ctx
        self.calls: list[dict[str, Any]] = []
        self.info: dict[str, Any] = {}
        self.type_kv = KV_TYPES["f16"]  # the ggml type of its K and V cache (set by _new_context)
        self.hidden: list[np.ndarray] | None = [] if hidden else None
        self.tracer = tracer  # kept alive with the context: llama.cpp holds its callback
        self.traces: list[dict[str, np.ndarray]] | None = [] if tracer is not None else None
        if hidden:
            engine.ext.llama_set_embeddings_nextn(ctx, True, False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.ctx:
            self.L.llama_free(self.ctx)
            self.ctx = None

    def _decode(self, batch, n: int, n_out: int, seqs) -> None:
        rc = self.L.llama_decode(self.ctx, batch)
        self.calls.append({"tokens": n, "outputs": n_out, "seq_ids": sorted(set(seqs))})
        if rc != 0:
            what = {1: "no KV slot for the batch", 2: "aborted", -1: "invalid batch"}.get(rc, "error")
            raise RuntimeError(f"llama-cpp backend: llama_decode returned {rc} ({what}) on a batch of {n} tokens: "
                               f"{self.e._log_tail()}")

    def _rows(self, idx: Sequence[int]) -> np.ndarray:
        V = self.e.n_vocab
        out = np.empty((len(idx), V), dtype=np.float32)
        for k, i in enumerate(idx):
            ptr = self.L.llama_get_logits_ith(self.ctx, int(i))
            if not ptr:
                raise RuntimeError(f"llama-cpp backend: llama_get_logits_ith({i}) returned NULL: {self.e._log_tail()}")
            out[k] = np.ctypeslib.as_array(ptr, shape=(V,))
        if self.hidden is not None:
            self.hidden.append(self.hidden_rows(idx))
        if self.tracer is not None:
            self.traces.append(self.tracer.take(out))
        return out

    def hidden_rows(self, idx: Sequence[int]) -> np.ndarray:
        """The final-norm states [len(idx), H] of the last batch's tokens at batch indices ``idx``."""
        H = self.e.n_embd
        out = np.empty((len(idx), H), dtype=np.float32)
        for k, i in enumerate(idx):
            ptr = self.e.ext.llama_get_embeddings_nextn_ith(self.ctx, int(i))
            if not ptr:
                raise RuntimeError(f"llama-cpp backend: llama_get_embeddings_nextn_ith({i}) returned NULL: "
                                   f"{self.e._log_tail()}")
            out[k] = np.ctypeslib.as_array(ptr, shape=(H,))
        return out

    def take_hidden(self) -> np.ndarray | None:
        """The hidden rows collected since the last take, [rows, H] (None when the request asks none)."""
        if self.hidden is None:
            return None
        got, self.hidden[:] = self.hidden[:], []
        return np.concatenate(got) if got else np.empty((0, self.e.n_embd), dtype=np.float32)

    def take_trace(self) -> dict[str, np.ndarray] | None:
        """The trace of the rows collected since the last take, point -> [rows, ...] (None when not tracing)."""
        if self.traces is None:
            return None
        got, self.traces[:] = self.traces[:], []
        return trace_rows(got)

    def _batch(self, items: Sequence[tuple[int, int, int, bool]], embd: np.ndarray | None = None) -> np.ndarray:
        """Decode one batch of (token, pos, seq, output) items; returns the logits of the outputs in order."""
        L = self.L
        n = len(items)
        batch = L.llama_batch_init(n, 0 if embd is None else embd.shape[1], 1)
        try:
            for i, (tok, pos, seq, want) in enumerate(items):
                if embd is None:
                    batch.token[i] = int(tok)
                batch.pos[i] = int(pos)
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = int(seq)
                batch.logits[i] = 1 if want else 0
            if embd is not None:
                flat = np.ascontiguousarray(embd, dtype=np.float32).ravel()
                ctypes.memmove(batch.embd, flat.ctypes.data, flat.nbytes)
            batch.n_tokens = n
            outs = [i for i, it in enumerate(items) if it[3]]
            self._decode(batch, n, len(outs), [it[2] for it in items])
            return self._rows(outs)
        finally:
            L.llama_batch_free(batch)

    def decode_tokens(self, tokens: Sequence[int], seq: int, pos0: int, rows) -> np.ndarray:
        rows = {int(r) for r in rows}
        return self._batch([(int(t), pos0 + i, seq, i in rows) for i, t in enumerate(tokens)])

    def decode_embeddings(self, emb: np.ndarray, seq: int, pos0: int, rows) -> np.ndarray:
        rows = {int(r) for r in rows}
        return self._batch([(0, pos0 + i, seq, i in rows) for i in range(emb.shape[0])], embd=emb)

    def decode_steps(self, seq: int, tokens: Sequence[int], pos0: int) -> np.ndarray | None:
        if not tokens:
            return None
        return np.concatenate([self._batch([(int(t), pos0 + j, seq, True)]) for j, t in enumerate(tokens)])

    def decode_multi(self, sequences, seq_ids) -> np.ndarray:
        items = []
        for toks, s in zip(sequences, seq_ids, strict=True):
            items += [(int(t), i, s, i == len(toks) - 1) for i, t in enumerate(toks)]
        return self._batch(items)

    def decode_multi_steps(self, seq_ids, decode, lens, mode: str) -> tuple[list[np.ndarray], list[np.ndarray] | None,
                                                                            list[dict[str, np.ndarray]] | None]:
        """Each sequence's decode logits [len(decode[i]), V], its hidden rows when the context keeps them, and its
        trace when it traces."""
        V, H = self.e.n_vocab, self.e.n_embd
        out = [np.empty((len(d), V), dtype=np.float32) for d in decode]
        hid = None if self.hidden is None else [np.empty((len(d), H), dtype=np.float32) for d in decode]
        trc: list[list[dict[str, np.ndarray]]] | None = None if self.traces is None else [[] for _ in decode]
        for j in range(max(len(d) for d in decode)):
            live = [i for i, d in enumerate(decode) if j < len(d)]
            if mode == "batched":
                rows = self._batch([(int(decode[i][j]), lens[i] + j, seq_ids[i], True) for i in live])
                h, t = self.take_hidden(), self.take_trace()
                for k, i in enumerate(live):
                    out[i][j] = rows[k]
                    if hid is not None:
                        hid[i][j] = h[k]
                    if trc is not None:
                        trc[i].append({name: a[k:k + 1] for name, a in t.items()})
            else:
                for i in live:
                    out[i][j] = self._batch([(int(decode[i][j]), lens[i] + j, seq_ids[i], True)])[0]
                    if hid is not None:
                        hid[i][j] = self.take_hidden()[0]
                    if trc is not None:
                        trc[i].append(self.take_trace())
        return out, hid, None if trc is None else [trace_rows(t) for t in trc]

    def seq_len(self, seq: int) -> int:
        mem = self.L.llama_get_memory(self.ctx)
        return int(self.L.llama_memory_seq_pos_max(mem, seq)) + 1
