"""One engine process of the subprocess backend: started in its own process group, its stdout read as
JSON lines on a thread, a ring buffer of its last stderr lines, a request awaited while the process is
polled for an exit (``_Process.call``: the reply, or ``_Died``, ``_TimedOut``, ``_Garbage``), and its end
(``_Process.shutdown``: the ``shutdown`` request, a grace period to exit by itself, then the process group
killed)."""

from __future__ import annotations

import fcntl
import json
import os
import queue
import signal
import struct
import subprocess
import termios
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from ...protocol.wire import clip_text

STDERR_LINES = 50  # the engine's last stderr lines kept for error messages


POLL_S = 0.25  # while waiting for a reply: how often the engine process is checked for an exit


EXIT_GRACE_S = 0.5  # after the engine process exited: how long a reply already on its way may take


SHUTDOWN_GRACE_S = 5.0  # after "shutdown": how long the engine may take to exit by itself before it is killed


class _Died(Exception):
    pass


class _TimedOut(Exception):
    pass


class _Garbage(Exception):
    pass


def _exit_text(rc: int | None) -> str:
    if rc is None:
        return "is still running"
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"was killed by signal {name} ({-rc})"
    return f"exited with code {rc}"


def _pipe_empty(fd: int) -> bool:
    """True when the pipe ``fd`` holds no unread bytes (False when that cannot be told)."""
    try:

        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0] == 0
    except Exception:  # noqa: BLE001 - another platform, or the fd is already closed
        return False


class _Process:
    """One engine process: its pipes, a stdout line queue, a ring buffer of its last stderr lines.

    The reader threads read the raw file descriptors (``os.read``) and close them themselves at end
    of file. Nothing else ever closes stdout or stderr: a helper the engine started in another session
    keeps them open after the engine's process group is killed, and closing a pipe while a thread
    blocks in a read on it would wait for that helper (or race with the read). Such a reader stays
    blocked, harmlessly, in its daemon thread until the helper exits.
    """

    def __init__(self, command: list[str], env: dict[str, str] | None, cwd: str | None, log):
        self.command = command
        try:
            self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, env=env, cwd=cwd, start_new_session=True)
        except BaseException:
            if log is not None:
                log.close()
            raise
        self.pgid = self.proc.pid  # start_new_session: the engine leads its own process group
        self.owner = os.getpid()  # the harness process that started it (a fork of the harness is not)
        self.lines: queue.Queue = queue.Queue()
        self.tail: deque[str] = deque(maxlen=STDERR_LINES)
        self.stderr_count = 0
        self.stderr_mark = 0  # stderr_count when the request being answered was sent (see stderr_text)
        self.op = "start"  # the op of that request
        self.next_id = 0
        self.killed = False
        self.ended: str | None = None  # after shutdown(): how the process ended
        self._err_fd = self.proc.stderr.fileno()
        self._err_waiting = False  # the stderr thread is blocked in os.read (holds no unprocessed bytes)
        self._out = threading.Thread(target=self._read_stdout, daemon=True)
        self._err = threading.Thread(target=self._read_stderr, args=(log,), daemon=True)
        self._out.start()
        self._err.start()

    @staticmethod
    def _chunks(stream, flag=None):
        """The bytes of a pipe as they arrive, until end of file (then the stream is closed)."""
        fd = stream.fileno()
        try:
            while True:
                if flag is not None:
                    flag(True)
                try:
                    chunk = os.read(fd, 65536)
                except OSError:
                    return
                finally:
                    if flag is not None:
                        flag(False)
                if not chunk:
                    return
                yield chunk
        finally:
            try:
                stream.close()
            except OSError:
                pass

    @staticmethod
    def _lines(chunks):
        rest = b""
        for chunk in chunks:
            *lines, rest = (rest + chunk).split(b"\n")
            yield from lines
        if rest:
            yield rest

    def _read_stdout(self) -> None:
        try:
            for raw in self._lines(self._chunks(self.proc.stdout)):
                self.lines.put(raw.decode("utf-8", errors="replace"))
        finally:
            self.lines.put(None)  # EOF

    def _set_err_waiting(self, waiting: bool) -> None:
        self._err_waiting = waiting

    def _read_stderr(self, log) -> None:
        try:
            for raw in self._lines(self._chunks(self.proc.stderr, self._set_err_waiting)):
                line = raw.decode("utf-8", errors="replace").rstrip("\r")
                self.tail.append(line)
                self.stderr_count += 1
                if log is not None:
                    try:
                        log.write(line + "\n")
                        log.flush()
                    except (OSError, ValueError):
                        pass
        finally:
            self._err_waiting = True
            if log is not None:
                try:
                    log.close()
                except OSError:
                    pass

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _stderr_settled(self) -> bool:
        """After a death: every stderr byte written so far has been read (or the pipe reached EOF)."""
        if not self._err.is_alive():
            return True
        return self._err_waiting and _pipe_empty(self._err_fd)

    def stderr_text(self) -> str:
        """The engine's stderr lines written since the request being answered was sent (at most the last
        STDERR_LINES of them), as a block to append to a message about that request. Earlier lines belong to
        earlier requests (the reference server logs each ``ok: false`` error there), so they are left out: an
        engine error is then quoted once, with its own case."""
        # after a death: let the last lines arrive. The pipe reaches EOF once the whole process group
        # is gone; a helper in another session may hold it open, so stop as soon as it is drained.
        deadline = time.monotonic() + 2.0
        settled = 0
        while time.monotonic() < deadline:
            self._err.join(timeout=0.05)
            settled = settled + 1 if self._stderr_settled() else 0
            if settled >= 2:
                break
        count = self.stderr_count - self.stderr_mark
        tail = list(self.tail)
        lines = tail[len(tail) - min(count, len(tail)):]
        if not lines:
            during = f" during {self.op}" if self.stderr_count else ""
            return f"\n(the engine wrote nothing on stderr{during})"
        head = f"engine stderr (last {len(lines)} of {count} lines):" if count > len(lines) else "engine stderr:"
        return "\n" + head + "\n" + "\n".join("  " + line for line in lines)

    def kill(self) -> None:
        """SIGKILL the whole process group (the engine and anything it started), then reap it.

        Only stdin is closed here; the reader threads close stdout and stderr at end of file."""
        self.killed = True
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        try:
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass

    def exit_text(self) -> str:
        """After stdout reached EOF or the engine exited: how it ended (reaped, group killed)."""
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            return "closed its stdout (it was then killed)"
        rc = self.proc.returncode
        self.kill()  # anything left in its process group
        return _exit_text(rc)

    def call(self, op: str, fields_: Mapping[str, Any], timeout: float) -> dict:
        """Send one request and wait for its reply. Raises _Died, _TimedOut or _Garbage.

        The reply is awaited in slices of POLL_S seconds; between them the engine process itself is
        checked: once it has exited (its children may still hold stdout open), a reply already on its
        way gets EXIT_GRACE_S seconds, then the death is reported (and the process group killed)."""
        mid = self.next_id
        self.next_id += 1
        self.op, self.stderr_mark = op, (self.stderr_count if mid > 0 else 0)  # hello: since the start
        data = (json.dumps({"id": mid, "op": op, **fields_}, separators=(",", ":")) + "\n").encode("utf-8")
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise _Died(self.exit_text()) from None
        deadline = time.monotonic() + timeout
        exited_at: float | None = None
        while True:
            now = time.monotonic()
            if exited_at is None and self.proc.poll() is not None:
                exited_at = now
            limit = deadline if exited_at is None else min(deadline, exited_at + EXIT_GRACE_S)
            try:
                if limit > now:
                    line = self.lines.get(timeout=min(limit - now, POLL_S))
                else:
                    line = self.lines.get_nowait()
            except queue.Empty:
                if time.monotonic() < limit:
                    continue
                if exited_at is not None or self.proc.poll() is not None:
                    raise _Died(self.exit_text()) from None
                raise _TimedOut() from None
            if line is None:
                raise _Died(self.exit_text())
            text = line.strip()
            if not text:
                continue
            try:
                reply = json.loads(text)
            except ValueError:
                raise _Garbage(f"wrote a line on stdout that is not JSON: {clip_text(text)!r} (stdout carries "
                               "only JSON replies, one per line; logs belong on stderr)") from None
            if not isinstance(reply, dict):
                raise _Garbage(f"wrote a JSON line on stdout that is not an object: {clip_text(text)!r}")
            if "id" not in reply:
                raise _Garbage(f"answered {op} (id {mid}) without the required field 'id': {clip_text(text)!r}")
            if reply["id"] != mid:
                raise _Garbage(f"answered {op} (id {mid}) with a reply whose id is {reply['id']!r}: "
                               f"{clip_text(text)!r}")
            if not isinstance(reply.get("ok"), bool):
                raise _Garbage(f"answered {op} without the required field 'ok' (true or false): {clip_text(text)!r}")
            return reply

    def shutdown(self, grace: float = SHUTDOWN_GRACE_S) -> str:
        """End the engine: send ``shutdown``, close its stdin (end of input also means "exit"), give it
        ``grace`` seconds in all to exit by itself, then SIGKILL its process group (the engine if it is still
        running, e.g. a v1 engine that ignores shutdown, and any helper left in the group). Returns how it
        ended (also kept in ``self.ended``): "exited with code 0 after shutdown", or "was killed after ...".
        Never raises for the engine's behaviour; a process already killed is left as it is."""
        if self.killed:
            return self.ended or "was killed"
        deadline = time.monotonic() + max(0.0, grace)
        try:
            if self.alive():
                try:
                    self.call("shutdown", {}, max(0.0, grace))
                except (_Died, _TimedOut, _Garbage):
                    pass  # died at once, ignored it, or answered something else: it still gets its grace
            try:
                self.proc.stdin.close()
            except (OSError, ValueError):
                pass
            try:
                self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            rc = self.proc.poll()
        finally:  # an interrupt while waiting still leaves nothing running
            self.kill()
        self.ended = (f"{_exit_text(rc)} after shutdown" if rc is not None
                      else f"was killed after a grace of {grace:g} s (it did not exit after shutdown)")
        return self.ended
