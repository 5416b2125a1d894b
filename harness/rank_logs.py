"""Why a trainer rank's process died, read from the rank's own log.

A rank that dies below Python (gloo's C++ abort on a point-to-point message whose size differs from the
receive posted for it, a segfault in an extension) raises nothing a caller could catch: Ray tells the driver
only `ActorDiedError` ("The actor died unexpectedly before finishing this task ... Worker exit type:
SYSTEM_ERROR"), whatever killed it. The cause is in the process's standard error, Ray's `worker-*.err` in
the session's logs, whose path each rank tells when it starts (`TrainerWorker.log_path`):
- an uncaught C++ exception, written by Ray's terminate handler as `Unhandled exception: <mangled type>.
  what(): <text>` followed by the native stack on the same line (gloo 2.x, torch 2.9: `N4gloo13EnforceNotMetE`,
  "op.preamble.length <= op.nbytes. 256 vs 252. Received data size doesn't match expected size."), or by
  libstdc++'s own handler as `terminate called after throwing an instance of '<type>'` and `  what():  <text>`;
- a fatal signal, written by Python's faulthandler as `Fatal Python error: Segmentation fault` with the
  Python stack of the thread it hit, or by Ray's signal handler as `*** SIGSEGV received at time=...`.

`death_cause` reads the first of these in a log's end; `with_death_cause` puts it into the rank's
`ErrorRecord`, so the CRASH check's message (its first line) names the cause instead of Ray's words.
When a rank dies mid-collective, its peers fail first, with gloo's "Connection reset by peer", which names
neither the dead rank nor its cause (`lost_a_peer`): `harness.rank_failures` then waits a moment for the
dead rank's own error, which the session records first.
"""

from __future__ import annotations

import os
import re

from harness.record import DIED, ErrorRecord

LOG_TAIL_BYTES = 64 * 1024  # how much of a dead rank's log is read (its cause and the native stack after it)
CAUSE_CHARS = 400  # the longest cause kept on a message's first line
KEPT_LOG_CHARS = 6000  # how much of the log's end goes into the record's traceback
STACK_CHARS = 20_000  # how far after a fatal report its Python stack (faulthandler's) is looked for

_UNHANDLED = re.compile(r"Unhandled exception: (?P<type>\S+?)\. what\(\): (?P<what>.*)")
_TERMINATE = re.compile(
    r"terminate called after throwing an instance of '(?P<type>[^']+)'(?:\s*\n\s*what\(\):\s*(?P<what>.*))?"
)
_FATAL_PYTHON = re.compile(r"Fatal Python error: (?P<what>.*)")
_RAY_SIGNAL = re.compile(r"\*\*\* (?P<what>SIG[A-Z]+) received at")
# A native stack frame that Ray's terminate handler writes on the line of the exception's text:
# "/path/libtorch_cpu.so(_ZN4gloo...+0x72) [0x7f27dd6fc1c2] gloo::transport::tcp::Pair::read()".
_NATIVE_FRAME = re.compile(r"\s/\S+\([^)\s]*\+0x[0-9a-f]+\)")
_LIBRARY = re.compile(r"site-packages|/lib/python3\.\d+/|^<frozen")  # files not of the program's own code
_PYTHON_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.MULTILINE)


def demangle(name: str) -> str:
    """A C++ type name as the Itanium ABI mangles it (`typeid(e).name()`), in source form for the simple cases
    an exception type takes: `N4gloo13EnforceNotMetE` -> `gloo::EnforceNotMet`, `St13runtime_error` ->
    `std::runtime_error`, `N3c105ErrorE` -> `c10::Error`. Anything else (templates, nested specials) is
    returned as it is."""
    body, parts = name, []
    if body.startswith("N") and body.endswith("E"):
        body = body[1:-1]
    if body.startswith("St"):
        parts.append("std")
        body = body[2:]
    while body:
        m = re.match(r"(\d+)", body)
        if m is None:
            return name
        n, start = int(m.group(1)), len(m.group(1))
        if n == 0 or start + n > len(body):
            return name
        parts.append(body[start : start + n])
        body = body[start + n :]
    return "::".join(parts) if parts else name


def _text(what: str | None) -> str:
    """An exception's text up to the native stack written after it, on one line, at most `CAUSE_CHARS`."""
    text = _NATIVE_FRAME.split(what or "", maxsplit=1)[0]
    text = " ".join(text.split())
    return text if len(text) <= CAUSE_CHARS else text[: CAUSE_CHARS - 3] + "..."


def _frame(m: re.Match[str]) -> str:
    """`f, package/file.py:10`: a faulthandler frame, its file as its last two path parts."""
    return f"{m.group('func')}, {'/'.join(m.group('file').split('/')[-2:])}:{m.group('line')}"


def _where_python_was(after: str) -> str:
    """` (Python was in recv, distributed/distributed_c10d.py:2799, called from collect, transport/sync.py:113)`:
    from faulthandler's dump after a fatal report, the thread it calls current (the one the signal hit) or,
    where none is (a C++ thread of gloo aborted), the last one it lists inside `torch.distributed` (the thread
    whose collective that was), else the last one (the main thread, the oldest): its innermost frame, and the
    innermost frame of a file outside the interpreter's library and site-packages (the program's own code)
    when that is another; "" when the dump lists no frame."""
    blocks = [b for b in re.split(r"\n\s*\n", after) if _PYTHON_FRAME.search(b)]
    if not blocks:
        return ""
    in_collective = [b for b in blocks if "torch/distributed/" in b]
    block = next((b for b in blocks if "Current thread" in b), (in_collective or blocks)[-1])
    frames = list(_PYTHON_FRAME.finditer(block))
    where = f" (Python was in {_frame(frames[0])}"
    own = next((f for f in frames if not _LIBRARY.search(f.group("file"))), None)
    if own is not None and own is not frames[0]:
        where += f", called from {_frame(own)}"
    return where + ")"


def death_cause(log: str) -> str | None:
    """The first fatal report in a dead process's log (module doc) in one line, with where Python was when
    faulthandler's stack follows it: `gloo::EnforceNotMet: [enforce fail at .../pair.cc:456]
    op.preamble.length <= op.nbytes. 256 vs 252. ... (Python was in recv, distributed/distributed_c10d.py:2591)`,
    `SIGSEGV received (Python was in string_at, ctypes/__init__.py:525)`; None when the log holds none (a
    process killed by SIGKILL, the kernel's OOM killer among them, or one that called `os._exit`, writes
    nothing)."""
    found: list[tuple[int, int, str]] = []  # (start, end, the report in words)
    for m in _UNHANDLED.finditer(log):
        found.append((m.start(), m.end(), f"{demangle(m.group('type'))}: {_text(m.group('what'))}"))
    for m in _TERMINATE.finditer(log):
        what = _text(m.group("what"))
        found.append((m.start(), m.end(), f"{m.group('type')}: {what}" if what else m.group("type")))
    for m in _FATAL_PYTHON.finditer(log):
        found.append((m.start(), m.end(), f"Fatal Python error: {_text(m.group('what'))}"))
    for m in _RAY_SIGNAL.finditer(log):
        found.append((m.start(), m.end(), f"{m.group('what')} received"))
    if not found:
        return None
    _, end, cause = min(found)
    return cause + _where_python_was(log[end : end + STACK_CHARS].split("Extension modules:")[0])


# What gloo raises on a rank whose peer's process went away mid-collective (torch 2.9's gloo, tcp/pair.cc):
# "Read error [127.0.0.1]:53130: Connection reset by peer", "Connection closed by peer [127.0.0.1]:38087".
_PEER_LOST = re.compile(r"by peer|Broken pipe")


def lost_a_peer(err: ErrorRecord) -> bool:
    """Whether `err` is a rank's follow-on error of a peer's death (gloo's connection reset or closed by the
    peer), which names neither the peer nor why it died: the dead rank's own error says that."""
    return err.type != DIED and bool(_PEER_LOST.search(err.message))


def read_tail(path: str | None, nbytes: int = LOG_TAIL_BYTES) -> str:
    """The last `nbytes` bytes of the file at `path` as text (undecodable bytes replaced), or "" when there
    is no path or it cannot be read (a rank on another node: its log is on that node's disk)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - nbytes))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


# Ray's account of how a worker ended, in `ActorDiedError`'s text: "Worker exit detail: Worker exits with an
# exit code 3." (`sys.exit(3)`), "... exit code 1. The process receives a SIGTERM.", or for a process that
# ended abruptly "Worker unexpectedly exits with a connection error code 2. End of file." (Ray 2.x).
_RAY_EXIT_DETAIL = re.compile(r"Worker exit detail: (?P<detail>.*?)(?:\s+Some common causes|\n|$)", re.DOTALL)


def ray_exit_detail(message: str) -> str | None:
    """How Ray says the worker ended, where it knows ("Worker exits with an exit code 3."), or None where
    the process ended abruptly (Ray saw only its connection close) or the text has no exit detail."""
    m = _RAY_EXIT_DETAIL.search(message)
    if m is None or "connection error" in m.group("detail"):
        return None
    return " ".join(m.group("detail").split())


def with_death_cause(err: ErrorRecord, log: str, path: str | None, phase: str | None = None) -> ErrorRecord:
    """`err` (a rank's `ActorDiedError`) with the cause its log gives (`death_cause`) as the first line of its
    message, the rank's last phase (`transport.progress`, where it was when it died) and, after it, Ray's
    words; the log's end goes into its traceback. Without a cause in the log, the first line gives how Ray
    says the worker ended (`ray_exit_detail`: an exit status, a SIGTERM) or, where it ended abruptly, what
    ends a process without a report (SIGKILL, the kernel's OOM killer, `os._exit`), and where the log is."""
    cause = death_cause(log)
    where = f"its log: {path}" if path else "its log could not be read"
    last = f"; its last phase: {phase}" if phase else ""
    if cause:
        first = f"the rank's process died: {cause}{last}"
    elif (detail := ray_exit_detail(err.message)) is not None:
        first = f"the rank's process ended without a fatal report in its log (Ray: {detail}{last}; {where})"
    else:
        first = (
            "the rank's process died without a fatal report in its log (it ended abruptly: killed by SIGKILL, "
            f"the kernel's OOM killer among them, or it called os._exit{last}; {where})"
        )
    kept = f"\n--- the end of the rank's log ({path}):\n{log[-KEPT_LOG_CHARS:]}" if log else ""
    return err.model_copy(update={"message": f"{first}\n{err.message}"[:4000], "traceback": err.traceback + kept})
