"""Progress of a generation run stage by stage: what each job (one base) is doing, the time it took, an estimate
of the time left, and the agreement of the KV-cache consistency check with its bound.

Worker side (``conformance.generate.jobs``): ``stage(base, name)`` times a stage of a job and reports it to
the sink of this process: the parent's ``StageLog`` when the job runs in the parent (``workers=1``), a queue
back to it in a local worker process (``set_sink``, from the pool's initializer), nothing on a Dask worker.
Events are small dicts: ``{"base", "event": "start", "worker"}``, ``{"base", "event": "stage", "stage",
"seconds"}`` and ``{"base", "event": "end"}`` (the last one of a job, so that the parent can print a job's
stages before the line of its result). Progress never fails a job: a sink that cannot take an event drops it.

Parent side (``conformance.generate.run``): ``StageLog(write, jobs)`` turns the events and the finished jobs'
metadata into lines such as ``base A: forward 12.3 s (elapsed 14.1 s, ETA 1 min 5 s)`` and ``consistency base
A: chunked vs full max |diff| 3.1e-15 (bound 1e-09) ok``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

from ..sets.bounds import has_events

Event = dict
Sink = Callable[[Event], None]
Write = Callable[[str], None]

# the share of a job's estimated cost each stage takes (normalised over the stages a job has)
STAGE_WEIGHTS = {"continuation": 1.0, "towers": 1.0, "forward": 1.5, "consistency": 1.5, "event probe": 1.5}

IN_PROCESS = "in this process"  # StageLog.plan's ``where`` when the jobs run in the parent

_sink: Sink | None = None  # this process's channel to the parent (a local worker process); None: nobody listens


def set_sink(sink: Sink | None) -> None:
    """Where ``stage`` and ``emit`` send this process's events when no sink is passed (a worker's queue)."""
    global _sink
    _sink = sink


def emit(event: Event, sink: Sink | None = None) -> None:
    """Send ``event`` to ``sink``, else to this process's sink (``set_sink``); dropped where nobody listens."""
    if sink is not None:
        sink(event)
    elif _sink is not None:
        with contextlib.suppress(Exception):  # a closed or broken queue: progress is lost, never the job
            _sink(event)


@contextlib.contextmanager
def stage(base: str, name: str, sink: Sink | None = None) -> Iterator[None]:
    """Time the stage ``name`` of ``base``'s job; reported when it ends (not when it fails)."""
    t0 = time.perf_counter()
    yield
    emit({"base": base, "event": "stage", "stage": name, "seconds": time.perf_counter() - t0}, sink)


def job_stages(spec: dict) -> list[str]:
    """The stages a job of ``spec`` goes through, in order (the rounding probe, run only where needed, aside;
    the event probe last under a ggml-cpu activation convention)."""
    events = ["event probe"] if has_events(spec.get("activations", "none")) else []
    if spec["kind"] == "text":
        return (["continuation"] if spec.get("greedy") else []) + ["forward", "consistency"] + events
    return ["towers", "forward", "consistency"] + events


def duration(seconds: float) -> str:
    """``12.3 s``, ``4 min 5 s``, ``1 h 2 min``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    s = int(round(seconds))
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def held_bound(meta: dict, floor: float) -> float:
    """The bound a finished job's consistency is held to: the larger of ``floor`` and the job's own bound (its
    float64 rounding bound, or 10 x its rounding probe; None for a job of an earlier version)."""
    derived = meta.get("consistency_bound")
    return max(floor, float(derived) if derived is not None else 0.0)


class StageLog:
    """The parent's progress lines for the jobs of a run, written with ``write(line)``. ``jobs``: the plan's jobs
    ({"base", "cost", "spec"}); ``floor``: the consistency bound's floor (run.CONSISTENCY_BOUND). The estimate
    of the time left is the cost of the stages not done yet at the rate (cost a second, all workers together)
    of the stages done so far in this run."""

    def __init__(self, write: Write | None, jobs: list[dict], floor: float, t0: float | None = None):
        self.write, self.floor = write, floor
        self.t0 = t0 if t0 is not None else time.perf_counter()
        self.shares: dict[str, dict[str, float]] = {}
        self.tokens = {q["base"]: len(q["spec"]["ids"]) + int(q["spec"].get("greedy") or 0) for q in jobs
                       if q["spec"]["kind"] == "text"}
        self.remote = True  # jobs run in other processes (their worker is named)
        for q in jobs:
            names = job_stages(q["spec"])
            weight = sum(STAGE_WEIGHTS[n] for n in names)
            self.shares[q["base"]] = {n: float(q["cost"]) * STAGE_WEIGHTS[n] / weight for n in names}
        self.todo = 0.0  # cost of the jobs this run computes
        self.done = 0.0  # of which done
        self.started: float | None = None  # when the first job of this run started

    def _line(self, text: str) -> None:
        if self.write is not None:
            self.write(text)

    def note(self, text: str) -> None:
        """A line of its own (e.g. a finished job found damaged)."""
        self._line(text)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def eta(self) -> str:
        if self.started is None or self.done <= 0:
            return "ETA unknown"
        left = max(self.todo - self.done, 0.0)
        rate = self.done / max(time.perf_counter() - self.started, 1e-9)
        return f"ETA {duration(left / rate)}"

    def plan(self, pending: list[dict], cached: list[str], where: str) -> None:
        """The jobs about to run (``pending``, in dispatch order) and the bases done in an earlier run."""
        self.todo = sum(sum(self.shares[q["base"]].values()) for q in pending)
        self.remote = where != IN_PROCESS
        for b in cached:
            self.shares.pop(b, None)
        self.started = time.perf_counter() if pending else None
        if pending:
            self._line(f"bases to compute: {', '.join(q['base'] for q in pending)} ({where})"
                       + (f"; done in an earlier run: {', '.join(cached)}" if cached else ""))

    def __call__(self, event: Event) -> None:
        """A worker's event (``emit``)."""
        b = event.get("base")
        if event.get("event") == "start":
            what = ", ".join(self.shares.get(b, {})) + (f"; {self.tokens[b]} tokens" if b in self.tokens else "")
            self._line(f"base {b}: started ({what})" + (f" on {event['worker']}" if self.remote and event.get("worker")
                                                        else "") + f", elapsed {duration(self.elapsed())}")
        elif event.get("event") == "stage":
            name = event["stage"]
            self.done += self.shares.get(b, {}).pop(name, 0.0)
            self._line(f"base {b}: {name} {duration(event['seconds'])} (elapsed {duration(self.elapsed())}, "
                       f"{self.eta()})")

    def finished(self, meta: dict, this_run: bool = True) -> None:
        """A job's result (its metadata; ``this_run`` False for a job done in an earlier run): the consistency
        line. The stages of the job not reported (a Dask worker reports none) count as done now."""
        b = meta["base"]
        left = self.shares.pop(b, {})
        if this_run:
            self.done += sum(left.values())
        if meta.get("consistency") is None:
            return
        seen, bound = float(meta["consistency"]), held_bound(meta, self.floor)
        probe = meta.get("rounding_probe")
        self._line(f"consistency base {b}: chunked vs full max |diff| {seen:.3g} (bound {bound:.3g}"
                   + (f", from its rounding probe {float(probe):.3g}" if probe is not None else "") + ") "
                   + ("ok" if seen <= bound else "over its bound"))
