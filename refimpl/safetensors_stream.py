"""Writing a safetensors file from chunk generators, so that a checkpoint larger than memory can be written
(``refimpl synth`` of the published shapes: the 31B's 57 GiB of BF16).

``write_safetensors_streamed(path, tensors, ahead=N)`` takes each tensor as (shape, chunks), where ``chunks()``
yields its values a piece at a time. With ``ahead`` 0 the writer draws and encodes them itself. With ``ahead`` N,
N worker threads draw and encode them while it writes, each taking the next tensor not yet taken (the chunk
functions must then be independent of each other, as the synthesiser's are, each tensor from its own generator).
The writer's tensor may hold AHEAD_QUEUE encoded chunks whatever else is held; every other chunk waits until the
chunks held ahead, all tensors together, fit the budget (``ahead_bytes()``: 2 GiB, or a quarter of the memory
available if less). So the workers run as far ahead as the budget allows, whatever the tensors' sizes. Before,
each of the next N tensors had a thread of its own that held two chunks at most: a large tensor (the 31B's MLP
matrices, 115M values, seven chunks) was drawn mostly while the writer waited for it, and a machine's threads
sat idle behind the one large tensor in turn (the 31B's 57 GiB: 0.19 GiB/s on 16 cores). The bytes are the same
whatever ``ahead`` and the budget: the writer takes the tensors and their chunks in order.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import threading
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from .safetensors_io import STORAGE, encode_tensor, header_blob

AHEAD_QUEUE = 2  # encoded chunks the writer's tensor may hold whatever the others hold
AHEAD_BYTES = 2 << 30  # at most this many encoded bytes held beyond those, all tensors together
MEMORY_SHARE = 4  # ... and at most this share of the memory available when the writing starts


def ahead_bytes(meminfo: str = "/proc/meminfo") -> int:
    """The budget of encoded bytes held ahead beyond the writer's tensor's AHEAD_QUEUE chunks: AHEAD_BYTES, or a
    MEMORY_SHARE-th of the memory available (MemAvailable; where that cannot be read, the free pages) if less."""
    available = None
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            return AHEAD_BYTES
    return max(0, min(AHEAD_BYTES, available // MEMORY_SHARE))


class _Pool:
    """``workers`` threads drawing and encoding the tensors of ``entries`` in order, each taking the next tensor
    not yet taken, into a queue per tensor. A chunk of the writer's current tensor is queued while that tensor
    holds fewer than AHEAD_QUEUE uncharged chunks; any other is charged to the budget (``limit`` bytes held, all
    tensors together) and waits for room. The writer's tensor was taken before any later one, and its worker
    never waits on the budget, so the writing always goes on. ``stop`` ends the workers at their next chunk."""

    def __init__(self, entries, tensors, workers: int, limit: int):
        self.entries, self.tensors, self.limit = entries, tensors, limit
        self.queues = [queue.Queue() for _ in entries]  # (item, bytes charged to the budget; 0: uncharged)
        self.uncharged = [0] * len(entries)
        self.taken = self.current = self.held = 0  # the next tensor to take, the writer's, the charged bytes
        self.changed, self.stop = threading.Condition(), threading.Event()
        self.threads = [threading.Thread(target=self._work, daemon=True) for _ in range(workers)]
        for thread in self.threads:
            thread.start()

    def _work(self) -> None:
        while True:
            with self.changed:
                if self.stop.is_set() or self.taken >= len(self.entries):
                    return
                i, self.taken = self.taken, self.taken + 1
            name, kind, _ = self.entries[i]
            try:
                for piece in _encoded(self.tensors[name][1], kind):
                    if not self._put(i, piece, len(piece[1])):
                        return
                self._put(i, None, 0)
            except BaseException as error:  # noqa: BLE001 - handed to the writer, which raises it
                self._put(i, error, 0)
                return

    def _put(self, i: int, item, nbytes: int) -> bool:
        """Queue ``item`` of tensor ``i`` uncharged or on the budget, waiting for either; False once stopped."""
        with self.changed:
            while True:
                if self.stop.is_set():
                    return False
                if i == self.current and self.uncharged[i] < AHEAD_QUEUE:
                    self.uncharged[i], charged = self.uncharged[i] + 1, 0
                    break
                if self.held + nbytes <= self.limit:
                    self.held, charged = self.held + nbytes, nbytes
                    break
                self.changed.wait(0.1)
        self.queues[i].put((item, charged))
        return True

    def pieces(self, i: int):
        """Tensor ``i``'s (values, bytes) pieces in order, for the writer; raises what its worker raised."""
        with self.changed:
            self.current = i
            self.changed.notify_all()
        while True:
            item, charged = self.queues[i].get()
            with self.changed:
                if charged:
                    self.held -= charged
                else:
                    self.uncharged[i] -= 1
                self.changed.notify_all()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self.stop.set()
        with self.changed:
            self.changed.notify_all()
        for thread in self.threads:
            thread.join()


def _encoded(chunks: Callable[[], Iterable[np.ndarray]], kind: str):
    """(values, bytes) of each chunk of a tensor, encoded as ``kind``."""
    for chunk in chunks():
        chunk = np.asarray(chunk)
        yield chunk.size, encode_tensor(chunk, kind)


@contextlib.contextmanager
def _tensor_pieces(entries, tensors, ahead: int, budget_bytes: int):
    """An iterator over the tensors of ``entries`` in order, each an iterator of its (values, bytes) pieces:
    drawn in the writer's thread (ahead 0), or on ``ahead`` worker threads (``_Pool``); the workers are stopped
    when the block ends."""
    if ahead <= 0:
        yield (_encoded(tensors[name][1], kind) for name, kind, _ in entries)
        return
    pool = _Pool(entries, tensors, min(ahead, len(entries)), budget_bytes)
    try:
        yield (pool.pieces(i) for i in range(len(entries)))
    finally:
        pool.close()


def write_safetensors_streamed(path: str | Path,
                               tensors: dict[str, tuple[tuple[int, ...], Callable[[], Iterable[np.ndarray]]]],
                               dtype: str = "BF16", metadata: dict[str, str] | None = None,
                               progress: Callable[[int, int], None] | None = None, ahead: int = 0,
                               budget_bytes: int | None = None) -> None:
    """``write_safetensors`` for float tensors given as (shape, chunks): ``chunks()`` yields the tensor's
    values in C order, a piece at a time (any shapes; only their sizes must add up). The bytes equal
    ``write_safetensors`` of the concatenated tensors; one chunk at a time is in memory, or with ``ahead`` N,
    N worker threads draw and encode the tensors in order, holding ``budget_bytes`` of chunks ahead at most
    (default ``ahead_bytes()``) beside AHEAD_QUEUE chunks of the writer's tensor (the same bytes).
    ``progress(bytes_done, bytes_total)`` is called after each chunk."""
    if dtype not in ("F64", "F32", "F16", "BF16"):
        raise ValueError(f"unsupported dtype {dtype!r}")
    entries = [(name, dtype, tuple(tensors[name][0])) for name in sorted(tensors)]
    total = sum(math.prod(shape) for _, _, shape in entries) * STORAGE[dtype].itemsize
    done = 0
    budget = ahead_bytes() if budget_bytes is None else budget_bytes
    with open(path, "wb") as f, _tensor_pieces(entries, tensors, ahead, budget) as by_tensor:
        f.write(header_blob(entries, metadata))
        for (name, _, shape), pieces in zip(entries, by_tensor, strict=True):
            want, got = math.prod(shape), 0
            for size, data in pieces:
                got += size
                if got > want:
                    break
                f.write(data)
                done += len(data)
                if progress is not None:
                    progress(done, total)
            if got != want:
                raise ValueError(f"tensor {name!r}: the chunks hold {got} values, its shape {list(shape)} needs {want}")
