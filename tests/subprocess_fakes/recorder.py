"""Records the subprocess protocol between the harness and an engine: ``python recorder.py LOG ENGINE_ARGV...``.

It runs the engine as its child (in the recorder's process group, so the harness's kill reaches both),
relays stdin to the engine and the engine's stdout back (stderr is inherited), and appends one JSON line
to LOG per message: ``{"to": "engine", "msg": {...}}`` for a request, ``{"to": "harness", "msg": {...}}``
for a reply (a line that is not JSON is kept as ``"text"``), each written before it is passed on, so
the order in LOG is the order of the conversation. When the engine's stdout ends, the recorder waits for
the engine, appends ``{"exit": CODE}`` (a negative CODE: killed by that signal) and exits with the same
code. Killed itself, it records nothing more: a missing "exit" line means the process group was killed.
"""

import json
import subprocess
import sys
import threading

LOG = sys.argv[1]
_lock = threading.Lock()


def record(entry: dict) -> None:
    with _lock, open(LOG, "a", encoding="utf-8") as log:
        log.write(json.dumps(entry) + "\n")


def parsed(line: bytes) -> dict:
    try:
        return {"msg": json.loads(line)}
    except ValueError:
        return {"text": line.decode("utf-8", errors="replace").rstrip("\n")}


def main() -> int:
    engine = subprocess.Popen(sys.argv[2:], stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def requests() -> None:
        for line in sys.stdin.buffer:
            if line.strip():
                record({"to": "engine", **parsed(line)})
            try:
                engine.stdin.write(line)
                engine.stdin.flush()
            except (BrokenPipeError, OSError):
                break
        record({"stdin": "closed"})
        try:
            engine.stdin.close()
        except OSError:
            pass

    threading.Thread(target=requests, daemon=True).start()
    for line in engine.stdout:
        if line.strip():
            record({"to": "harness", **parsed(line)})
        sys.stdout.buffer.write(line)
        sys.stdout.buffer.flush()
    code = engine.wait()
    record({"exit": code})
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
