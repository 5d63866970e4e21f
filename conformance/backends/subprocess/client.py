"""The client of the subprocess protocol: a backend that drives an inference engine in another process
through the language-neutral protocol ``gemma4-conformance-subprocess`` version 1 (docs/subprocess-protocol.md;
the wire format is ``conformance.protocol.wire``, one engine process ``process``).

The engine is any program (C++, Rust, Swift, Python, ...) that reads one JSON request per line on
its stdin and writes one JSON reply per line on its stdout; logits travel as files (raw
little-endian arrays or safetensors) in a directory the harness gives with each request.

    conformance check --backend subprocess --backend-option command="./my-engine --serve"
    conformance check --backend refimpl-subprocess        # the oracle behind the protocol server

``SubprocessBackend`` starts the command in its own process group and says ``hello`` in the
constructor (name and capabilities are known before ``open``). A crash is never fatal to the run:

* the process dies (or hangs past ``timeout``, or breaks the protocol) during ``run``: that case is
  an error whose message says how it died (exit code or signal name, e.g. SIGABRT) with the last
  stderr lines; the next ``run`` restarts the process, says hello again (the same capabilities are
  required) and re-opens the model directory;
* the process dies (or hangs) during ``open``: every ``run`` on that model fails at once with that
  message (no restart loop) until the next ``open``;
* an engine that cannot start, speaks another protocol version, writes something other than JSON on
  stdout or answers ``open`` with ``ok: false`` raises ``BackendError`` (exit code 4).

A death is noticed from the engine process itself (it is polled while a reply is awaited), not only
from its stdout closing: the workers of a multi-process engine may keep stdout open after the main
process aborts. Killing is by process group; a helper that left the group (a new session) survives
it, but never blocks the harness (stdout and stderr are only closed by their reader threads). On
SIGTERM or SIGHUP of the harness the engine process groups are killed before it dies (see
``_install_signal_cleanup``).

The end of a run: ``close`` only releases the fixture set's model (one process serves every set of a run),
so the engine is ended when the backend is done with it: ``shutdown()``, called by the owner, when the
backend object is collected (``conformance check`` drops it when the run is over) and at interpreter exit
(``atexit``). Each sends ``shutdown``, closes the engine's stdin, waits ``shutdown_grace`` seconds (5 by
default) for it to exit by itself and then kills its process group (``_Process.shutdown``): an engine that
honours ``shutdown`` exits with code 0 and is never killed; a v1 engine that ignores it is killed after the
grace.

Image prompts travel as fields added after v1 (``images`` on the request, ``embeddings`` on each
piece, the ``image_prompts`` capability, read as not claimed when a v1 engine's hello leaves it out);
an image request is never sent to an engine that does not claim ``image_prompts``. Audio prompts
likewise (``audio`` and ``audio_inputs`` on the request, each clip's features and frame mask written
as raw float64 files; the ``audio_prompts`` and ``audio_tower`` capabilities); an audio request is
never sent to an engine that does not claim ``audio_prompts``; a video request (its frames among the image
blocks, ``videos`` naming them) to one that does not claim ``video_prompts``; an MTP request after media to one
that does not claim ``mtp_media``; a batched MTP request to one that does not claim ``mtp_batch``.

``RefimplSubprocessBackend`` runs ``python -m conformance.serve --backend
refimpl``: the oracle behind the protocol, which must pass every bundled case at ``exact-f64``.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from refimpl.config import load_config

from ...protocol.types import BackendError, Capabilities, Request, Response
from ...protocol.wire import (
    PROTOCOL,
    VERSIONS,
    EngineCrash,
    EngineError,
    EngineFailure,
    EngineTimeout,
    ProtocolError,
    capabilities_from_json,
    clip_text,
    request_to_json,
)
from .process import SHUTDOWN_GRACE_S, _Died, _Garbage, _Process, _TimedOut
from .reply import response_from_reply

# What each reply must carry besides "id" and "ok" (docs/subprocess-protocol.md, one table per message). A reply
# with "ok": false must carry "error" (a string); "run" needs more, depending on the request
# (``reply.response_from_reply``).
HELLO_REQUIRED = ("protocol", "version", "capabilities")  # "name" and "engine" are optional

def _vocab_size(model_dir: Path) -> int | None:
    """The checkpoint's full vocabulary (V of every logits row), or None when it cannot be read."""
    try:
        return int(load_config(model_dir).vocab_size)
    except Exception:  # noqa: BLE001 - fall back to the raw config; shapes are still checked row-wise
        pass
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
        v = text.get("vocab_size", cfg.get("vocab_size"))
        return int(v) if isinstance(v, int) else None
    except Exception:  # noqa: BLE001 - an unreadable config: no vocab known
        return None


def _command_list(command: Any) -> list[str]:
    if isinstance(command, str) and command.lstrip().startswith("["):
        try:  # a JSON array of arguments, e.g. command='["./my engine", "--serve"]'
            command = json.loads(command)
        except ValueError:
            pass
    if isinstance(command, str):
        argv = shlex.split(command)
    elif isinstance(command, (list, tuple)):
        argv = [str(c) for c in command]
    else:
        argv = []
    if not argv:
        raise BackendError("the subprocess backend needs the engine's command, e.g. "
                           "--backend-option command=\"./my-engine --serve\" (got "
                           f"{command!r})")
    return argv


def _engine_error(op: str, reply: dict) -> str:
    """The ``error`` of an ``ok: false`` reply to ``op``: required, a string (ProtocolError otherwise)."""
    if "error" not in reply:
        raise ProtocolError(f"the {op} reply (ok: false) lacks the required field 'error'")
    error = reply["error"]
    if not isinstance(error, str):
        raise ProtocolError(f"the {op} reply's 'error' must be a string, got {clip_text(repr(error))}")
    return error


def _failed(error: str) -> EngineError:
    """The EngineError of a run the engine answered with ``ok: false``; ``engine_error`` keeps the engine's own
    message, so that a protocol server whose backend is itself a subprocess client passes it on as it is
    instead of wrapping it a second time (``server._error_text``)."""
    exc = EngineError(f"the engine failed on this request: {error}")
    exc.engine_error = error
    return exc


def _env(env: Any) -> dict[str, str] | None:
    """Extra environment variables (a dict, or a JSON object as text) on top of the harness's own."""
    if env is None or env == "":
        return None
    if isinstance(env, str):
        try:
            env = json.loads(env)
        except ValueError:
            env = None
    if not isinstance(env, Mapping):
        raise BackendError("the subprocess backend's env must be an object of variables, e.g. "
                           "--backend-option env='{\"CUDA_VISIBLE_DEVICES\": \"0\"}'")
    merged = dict(os.environ)
    merged.update({str(k): str(v) for k, v in env.items()})
    return merged


_LIVE: weakref.WeakSet[SubprocessBackend] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:  # no engine process outlives the harness: shutdown, the grace, then killed
    for backend in list(_LIVE):
        try:
            backend.shutdown()
        except Exception:  # noqa: BLE001 - at exit: stop every engine whatever fails
            pass


# SIGTERM / SIGHUP: Python dies of them without running atexit, which would leave every engine
# process group running (they live in their own sessions, so a terminal's hangup does not reach
# them either). While a signal's handler is still the default one, the first backend made in the main
# thread installs a handler that SIGKILLs every live engine process group, then restores the default
# and re-raises the signal: the harness still dies of it, with the same status. A handler installed by
# the application (or SIG_IGN) is left alone. Nothing helps against SIGKILL of the harness: an engine
# then sees end of file on its stdin, which the protocol says means "exit".
# (PR_SET_PDEATHSIG is not used: it needs preexec_fn, which is unsafe in a process with threads,
# fires when the starting *thread* exits, and reaches only the engine, not its helpers.)
_FATAL_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))


_installed_in: int | None = None  # the process that installed the handler (a fork inherits it)


def _kill_all_groups() -> None:
    """SIGKILL the process group of every engine this process started (not those of a parent it was
    forked from)."""
    for backend in list(_LIVE):
        proc = getattr(backend, "_proc", None)
        if proc is not None and not proc.killed and proc.owner == os.getpid():
            try:
                os.killpg(proc.pgid, signal.SIGKILL)
            except OSError:
                pass


def _on_fatal_signal(signum: int, frame: Any) -> None:
    _kill_all_groups()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die of the signal, as without this handler


def _install_signal_cleanup() -> None:
    global _installed_in
    if _installed_in == os.getpid() or threading.current_thread() is not threading.main_thread():
        return
    _installed_in = os.getpid()
    for sig in _FATAL_SIGNALS:
        try:
            if signal.getsignal(sig) is signal.SIG_DFL:
                signal.signal(sig, _on_fatal_signal)
        except (ValueError, OSError):
            pass


def _seconds(label: str, v: Any) -> float:
    """A timeout option: a finite positive number of seconds (BackendError otherwise)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
        raise BackendError(f"the subprocess backend's {label} must be a positive number of seconds, got {v!r}")
    if not math.isfinite(v):
        raise BackendError(f"the subprocess backend's {label} must be a positive number of seconds, got {v!r} "
                           "(a finite number: there is no unlimited timeout; give a large one instead)")
    return float(v)


def _grace(v: Any) -> float:
    """The shutdown_grace option: a finite number of seconds, 0 or more (BackendError otherwise)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0 or not math.isfinite(v):
        raise BackendError(f"the subprocess backend's shutdown_grace must be a finite number of seconds, 0 or more, "
                           f"got {v!r}")
    return float(v)


class SubprocessBackend:
    """An engine in another process, spoken to with the subprocess protocol (docs/subprocess-protocol.md).

    ``command``: the engine's argv (a list, a string split with shlex, or a JSON array as text). ``name``: overrides the
    name the engine gives in hello (an engine that gives none is named after its program, ``command[0]``).
    ``timeout``: seconds for one open or run (past it the process group is killed; the case is an error; the
    next run restarts the engine). ``env``: extra
    environment variables (a dict, or a JSON object as text). ``cwd``: the engine's working
    directory. ``startup_timeout``: seconds from start to the hello reply. ``open_timeout``: seconds
    for one open (None: ``timeout``; an engine that converts the checkpoint while opening may need much
    longer than one request). ``stderr_log``: a file that receives the engine's whole stderr
    (appended), besides the last lines kept for messages; it is opened (created) in the constructor.
    ``shutdown_grace``: seconds the engine has to exit by itself after ``shutdown`` (at the end: ``shutdown()``,
    the object collected, interpreter exit) before its process group is killed; 0 kills it at once.
    Timeouts are finite positive numbers (BackendError otherwise).

    Subclasses build their own command and pass it to ``__init__``; ``self._command`` is the argv
    every (re)start uses.
    """

    def __init__(self, command: str | Sequence[str] | None = None, name: str | None = None,
                 timeout: float = 600.0, env: Mapping[str, str] | str | None = None,
                 cwd: str | None = None, startup_timeout: float = 60.0, stderr_log: str | None = None,
                 open_timeout: float | None = None, shutdown_grace: float = SHUTDOWN_GRACE_S):
        self._command = _command_list(command)
        self.timeout = _seconds("timeout", timeout)
        self.shutdown_grace = _grace(shutdown_grace)
        self.startup_timeout = _seconds("startup_timeout", startup_timeout)
        self.open_timeout = None if open_timeout is None else _seconds("open_timeout", open_timeout)
        self._env = _env(env)
        self._cwd = None if cwd is None else str(cwd)
        self._stderr_log = None if stderr_log in (None, "") else str(stderr_log)
        if self._stderr_log is not None:
            try:
                self._open_log().close()
            except OSError as exc:
                raise BackendError(f"the subprocess backend cannot open its stderr_log file {self._stderr_log!r} "
                                   f"for appending: {exc.strerror or exc}") from None
        self._proc: _Process | None = None
        self._model_dir: Path | None = None
        self._vocab: int | None = None
        self._broken: EngineFailure | None = None  # every run fails fast with it until the next open
        self.restarts = 0
        self.version: int | None = None
        self.engine: dict[str, Any] = {}
        _LIVE.add(self)
        _install_signal_cleanup()
        try:
            hello = self._start()
        except EngineFailure as exc:
            raise BackendError(f"subprocess backend: {exc}") from None
        self.version = hello["version"]
        self.capabilities: Capabilities = hello["capabilities"]
        self.engine = hello["engine"]
        # the name option, else the engine's (optional in hello), else its program's
        self.name: str = name if name else (hello["name"] or Path(self._command[0]).name)

    # -- process lifecycle ----------------------------------------------------------------------

    def _label(self) -> str:
        text = shlex.join(self._command)
        return clip_text(text, 200)

    def _open_log(self):
        return open(self._stderr_log, "a", encoding="utf-8")  # the stderr thread closes it

    def _alive(self) -> bool:
        return self._proc is not None and not self._proc.killed and self._proc.alive()

    def _discard(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc = None

    def _call(self, op: str, fields: dict[str, Any], timeout: float, *, died, timed_out: str, garbage) -> dict:
        """One request on the current process, its reply. A death, a timeout or a garbled reply becomes
        EngineCrash ``died(exc)``, EngineTimeout ``timed_out`` or ProtocolError ``garbage(exc)``, each
        followed by the engine's stderr tail; the process is gone afterwards (killed if it still ran)."""
        proc = self._proc
        assert proc is not None
        try:
            return proc.call(op, fields, timeout)
        except _Died as exc:
            self._proc = None
            raise EngineCrash(died(exc) + proc.stderr_text()) from None
        except _TimedOut:
            self._discard()
            raise EngineTimeout(timed_out + proc.stderr_text()) from None
        except _Garbage as exc:
            self._discard()
            raise ProtocolError(garbage(exc) + proc.stderr_text()) from None

    def _start(self) -> dict[str, Any]:
        """Start ``self._command`` and say hello; returns the checked hello fields. Raises EngineFailure."""
        self._discard()
        if self.version is not None:
            self.restarts += 1  # every start after the first (a crash, a timeout, a failed close)
        try:
            log = None if self._stderr_log is None else self._open_log()
        except OSError as exc:
            raise EngineCrash(f"cannot open the stderr_log file {self._stderr_log!r} for appending: "
                              f"{exc.strerror or exc}") from None
        try:
            proc = _Process(self._command, self._env, self._cwd, log)
        except OSError as exc:
            raise EngineCrash(f"cannot start the engine command [{self._label()}]: {exc.strerror or exc}") from None
        self._proc = proc
        what = f"the engine command [{self._label()}]"
        reply = self._call(
            "hello", {"protocol": PROTOCOL, "versions": list(VERSIONS)}, self.startup_timeout,
            died=lambda exc: f"{what} {exc} before answering hello",
            timed_out=f"{what} did not answer hello within {self.startup_timeout:g} s (startup_timeout); it was killed",
            garbage=lambda exc: f"{what} {exc}")
        try:
            return self._check_hello(reply)
        except EngineError as exc:  # ok: false: the engine's own message, shown once, as it is
            self._discard()
            raise EngineError(f"{what}: {exc}") from None
        except ProtocolError as exc:
            self._discard()
            raise ProtocolError(f"{what}: {exc}{proc.stderr_text()}") from None

    @staticmethod
    def _check_hello(reply: dict) -> dict[str, Any]:
        """The hello reply's fields, checked as docs/subprocess-protocol.md's hello table says: ``protocol``,
        ``version`` and ``capabilities`` (with every v1 field) required; ``name`` (None when absent, null or
        empty) and ``engine`` ({} when absent or null; another value than an object as {"info": value})
        optional; anything else ignored."""
        if not reply["ok"]:
            raise EngineError(f"the engine refused hello: {_engine_error('hello', reply)}")
        for key in HELLO_REQUIRED:
            if key not in reply:
                raise ProtocolError(f"the hello reply lacks the required field {key!r}")
        if reply["protocol"] != PROTOCOL:
            raise ProtocolError(f"the hello reply names protocol {reply['protocol']!r}, not {PROTOCOL!r}")
        version = reply["version"]
        if isinstance(version, bool) or version not in VERSIONS:
            raise ProtocolError(f"the engine speaks protocol version {version!r}; this harness speaks "
                                f"{', '.join(map(str, VERSIONS))} (offered in hello 'versions')")
        try:  # every v1 field required, later ones optional: "the hello reply's 'capabilities' lacks decode (...)"
            caps = capabilities_from_json(reply["capabilities"])
        except (ValueError, TypeError) as exc:
            raise ProtocolError(f"the hello reply's {exc}") from None
        name = reply.get("name")
        if name is not None and not isinstance(name, str):
            raise ProtocolError(f"the hello reply's 'name' must be a string, got {clip_text(repr(name))}")
        engine = reply.get("engine")
        return {"version": version, "name": name or None, "capabilities": caps,
                "engine": {} if engine is None else engine if isinstance(engine, dict) else {"info": engine}}

    def _open_engine(self, model_dir: Path) -> None:
        """Send open on the current process. Raises EngineError (ok false), EngineCrash, EngineTimeout
        or ProtocolError; on anything but EngineError the process is gone."""
        timeout, label = ((self.timeout, "timeout") if self.open_timeout is None
                          else (self.open_timeout, "open_timeout"))
        reply = self._call(
            "open", {"model_dir": str(model_dir)}, timeout,
            died=lambda exc: f"the engine process died while opening {model_dir}: it {exc}",
            timed_out=(f"the engine did not finish opening {model_dir} within {timeout:g} s ({label}); "
                       "its process group was killed"),
            garbage=lambda exc: f"while opening {model_dir} the engine {exc}")
        if not reply["ok"]:
            raise EngineError(f"the engine could not open {model_dir}: {_engine_error('open', reply)}")

    def _start_again(self) -> None:
        """Start a fresh process; it must declare the same capabilities and version as the first one."""
        hello = self._start()
        if hello["capabilities"] != self.capabilities or hello["version"] != self.version:
            self._discard()
            raise ProtocolError(f"the restarted engine declares other capabilities or protocol version "
                                f"(version {hello['version']}, {hello['capabilities'].to_dict()}) than at start "
                                f"(version {self.version}, {self.capabilities.to_dict()})")

    def _restart(self) -> None:
        """Start a fresh process for the open model: hello (same capabilities) and open again."""
        self._start_again()
        assert self._model_dir is not None
        try:
            self._open_engine(self._model_dir)
        except EngineError:
            self._discard()
            raise

    def set_case_timeout(self, seconds: float) -> None:
        """``conformance check --case-timeout``: ``seconds`` for one run (the process group is killed past
        it, the case is an error, the engine restarts); open keeps the limit it had."""
        if self.open_timeout is None:
            self.open_timeout = self.timeout
        self.timeout = _seconds("case timeout", seconds)

    # -- protocol -------------------------------------------------------------------------------

    def open(self, model_dir: Path) -> None:
        model_dir = Path(model_dir).resolve()
        self._model_dir = model_dir
        self._broken = None
        self._vocab = _vocab_size(model_dir)
        if not self._alive():
            try:
                self._start_again()
            except EngineFailure as exc:
                raise BackendError(f"subprocess backend {self.name!r}: cannot start the engine to open "
                                   f"{model_dir}: {exc}") from None
        try:
            self._open_engine(model_dir)
        except (EngineCrash, EngineTimeout) as exc:
            # the run goes on: every request on this model fails fast with this message
            self._broken = type(exc)(f"{exc}\n(every request on this model fails without running until "
                                     "the next open)")
        except (EngineError, ProtocolError) as exc:
            raise BackendError(f"subprocess backend {self.name!r}: {exc}") from None

    def run(self, request: Request) -> Response:
        if self._broken is not None:
            raise type(self._broken)(str(self._broken))
        if self._model_dir is None:
            raise RuntimeError("subprocess backend: run() called before open()")
        if request.images and not self.capabilities.image_prompts:
            # the harness never sends one (required_capabilities); a v1 engine would ignore the images
            # and piece embeddings and answer a text prompt, so refuse here rather than grade that
            raise ValueError(f"subprocess backend {self.name!r}: the engine does not claim image_prompts; an "
                             f"image request is not sent to it")
        if request.audio and not self.capabilities.audio_prompts:
            # likewise: an engine without audio_prompts would answer the prompt as text
            raise ValueError(f"subprocess backend {self.name!r}: the engine does not claim audio_prompts; an "
                             f"audio request is not sent to it")
        if request.videos and not self.capabilities.video_prompts:
            # likewise: an engine without video_prompts would take the frames' video tokens for text
            raise ValueError(f"subprocess backend {self.name!r}: the engine does not claim video_prompts; a "
                             f"video request is not sent to it")
        if request.kind == "mtp" and (request.images or request.audio) and not self.capabilities.mtp_media:
            # likewise: an engine without mtp_media would draft after the placeholders as text
            raise ValueError(f"subprocess backend {self.name!r}: the engine does not claim mtp_media; an MTP "
                             f"request after media is not sent to it")
        if request.mtp_batch and not self.capabilities.mtp_batch:
            # likewise: an engine without mtp_batch would find no "mtp" request in it
            raise ValueError(f"subprocess backend {self.name!r}: the engine does not claim mtp_batch; a batched "
                             f"MTP request is not sent to it")
        if request.kind == "multi" and request.decode and not any(request.decode):
            request = dataclasses.replace(request, decode=())  # no sequence has a step: sent as "decode": []
        if not self._alive():
            try:
                self._restart()
            except EngineFailure as exc:
                self._broken = EngineCrash(f"the engine could not be restarted after it stopped: {exc}\n"
                                           "(every request on this model fails without running until the "
                                           "next open)")
                raise EngineCrash(str(self._broken)) from None
        out_dir = tempfile.mkdtemp(prefix="gemma4-subprocess-")
        try:
            payload = {"request": request_to_json(request, out_dir), "out_dir": out_dir}
            reply = self._call(
                "run", payload, self.timeout,
                died=lambda exc: f"the engine process died during run: it {exc}; it is restarted for the next request",
                timed_out=(f"the engine did not answer run within {self.timeout:g} s (timeout); its process group "
                           "was killed and it is restarted for the next request"),
                garbage=lambda exc: f"during run the engine {exc}; it was killed and is restarted for the next request")
            if not reply["ok"]:
                raise _failed(_engine_error("run", reply))
            return response_from_reply(reply, request, out_dir, self._vocab)
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)

    def close(self) -> None:
        self._model_dir = None
        self._broken = None
        if not self._alive():
            return
        proc = self._proc
        try:
            reply = proc.call("close", {}, min(self.timeout, 60.0))
        except _Died:
            self._proc = None
            return
        except (_TimedOut, _Garbage):
            self._discard()  # the next open starts a fresh process
            return
        if not reply["ok"]:
            self._discard()

    def shutdown(self, grace: float | None = None) -> str | None:
        """End the engine: send ``shutdown``, close its stdin, wait ``grace`` seconds (default: the
        ``shutdown_grace`` option) for it to exit by itself, then kill its process group. Returns how it ended
        ("exited with code 0 after shutdown", "was killed after a grace of 5 s ..."), None when no engine ran.
        Also done when the object is collected and at interpreter exit. The next ``open`` starts a new engine.
        An engine started by another process (this one is a fork of the harness) is left alone."""
        proc, self._proc = getattr(self, "_proc", None), None
        if proc is None or proc.owner != os.getpid():
            return None
        return proc.shutdown(self.shutdown_grace if grace is None else grace)

    def __del__(self):
        # the owner dropped the backend (``conformance check`` at the end of its run): the engine is ended the
        # same way as by shutdown()
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - best effort, as shutdown()
            pass


class RefimplSubprocessBackend(SubprocessBackend):
    """The refimpl oracle behind the protocol server: ``python -m conformance.serve
    --backend refimpl --format FORMAT``. ``format``: how logits travel ("raw" or "safetensors");
    ``dtype``: "float64" (the oracle, profile exact-f64) or "float32" (refimpl-float32, profile fp32).
    Other keyword arguments go to SubprocessBackend (timeout, ...)."""

    def __init__(self, format: str = "raw", dtype: str = "float64", **kwargs: Any):
        if format not in ("raw", "safetensors"):
            raise BackendError(f"refimpl-subprocess: format must be 'raw' or 'safetensors', got {format!r}")
        if dtype not in ("float64", "float32"):
            raise BackendError(f"refimpl-subprocess: dtype must be 'float64' or 'float32', got {dtype!r}")
        inner = "refimpl" if dtype == "float64" else "refimpl-float32"
        command = [sys.executable, "-m", "conformance.serve", "--backend", inner,
                   "--format", format]
        kwargs.setdefault("name", f"{inner}-subprocess")
        super().__init__(command, **kwargs)


class IsolatedBackend(SubprocessBackend):
    """Any Python backend in a child process behind the protocol server (``conformance check --isolate``):
    what in-process code cannot survive (``os._exit``, a segfault, a hang past the timeout) ends only
    the child, the case is an error, and the child is restarted for the next case.

    ``spec`` and ``options`` are what ``registry.load_backend`` takes; the child loads the backend with
    them (it inherits the environment and working directory, so ``module:attr`` resolves as here).
    Other keyword arguments go to SubprocessBackend (``timeout``: seconds a run may take)."""

    def __init__(self, spec: str, options: Mapping[str, Any] | None = None, **kwargs: Any):
        try:
            encoded = json.dumps(dict(options or {}))
        except (TypeError, ValueError) as exc:
            raise BackendError(f"--isolate: the backend options cannot be sent to the child process: {exc}") from None
        command = [sys.executable, "-m", "conformance.serve", "--backend", spec,
                   "--backend-options-json", encoded]
        # the child may end an engine of its own at its exit (a SubprocessBackend behind the server gets its own
        # shutdown and grace): wait for that before killing the child
        inner = (options or {}).get("shutdown_grace", SHUTDOWN_GRACE_S)
        if not isinstance(inner, (int, float)) or isinstance(inner, bool) or not math.isfinite(inner) or inner < 0:
            inner = SHUTDOWN_GRACE_S
        kwargs.setdefault("shutdown_grace", SHUTDOWN_GRACE_S + inner)
        super().__init__(command, **kwargs)
        shipped = self.engine.get("expectations_file")
        self.expectations_file = Path(shipped) if isinstance(shipped, str) and shipped else None


