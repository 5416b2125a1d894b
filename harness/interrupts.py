"""SIGTERM and SIGINT end a run as Ctrl-C does, also where Python drops the KeyboardInterrupt they raise.

`install` makes `on_signal` the handler: it raises KeyboardInterrupt and keeps the signal. A handler's
exception that lands in code whose exceptions Python only prints ("Exception ignored in ...") is lost: an
at-fork hook such as logging's `_releaseLock`, which runs in the parent after a fork such as Ray's
`Popen(preexec_fn=...)` of its own processes, a finalizer, a `__del__`. `raise_if_signalled` raises it
again; the run loop calls it before each scenario (`harness.cli.run_scenarios`) and a scenario's waits on its
ranks and engines call it every slice (`harness.watch.wait_watched`), so a lost signal ends the scenario
within about a second instead of at its end.

A KeyboardInterrupt that was delivered is not raised a second time: whoever catches it and handles it (the
runner, around one scenario) calls `delivered`, so the waits of a process that goes on after handling it (a
test session, a caller of `harness.runner.Runner`) do not raise it again. The scenario
it interrupted keeps its record, judged, with `interrupted_error` among its errors and every trainer rank's
last phase in `RunRecord.progress`: a hang that someone stopped by hand says where it hung.

A run's `close` runs under `held`: a signal while it stops the run's processes and writes its tables is
raised once it has ended (a second one at once, cutting short the step it lands in).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import traceback
from collections.abc import Iterator
from types import FrameType

from harness.record import INTERRUPTED, ErrorRecord, RunRecord

_signalled: int | None = None  # the SIGTERM or SIGINT not yet seen delivered, once this process got one
_last: int | None = None  # the last SIGTERM or SIGINT this process got (never cleared): what ends the run
_holding = False  # inside `held`: the first signal is kept for the block's end instead of raised
_held: int | None = None  # the signal `held` keeps
_deferring = False  # inside `deferred`: every signal is kept, and delivered once the block has ended
_deferred: list[int] = []  # the signals `deferred` keeps, in the order they came


def on_signal(signum: int, frame: FrameType | None) -> None:
    """SIGTERM's and SIGINT's handler: raises KeyboardInterrupt("signal N"), as Ctrl-C does, and keeps the
    signal for `raise_if_signalled`; inside `held`, the first signal is kept for the block's end instead."""
    global _signalled, _last, _held
    _last = signum
    if _deferring:
        _deferred.append(signum)
        return
    if _holding and _held is None:
        _held = signum
        return
    _signalled = signum
    raise KeyboardInterrupt(f"signal {signum}")


def raise_if_signalled() -> None:
    """Raise KeyboardInterrupt again where this process got SIGTERM or SIGINT whose KeyboardInterrupt has not
    been seen delivered (`delivered`): it was lost where Python ignores exceptions, and the run would otherwise
    go on to its end and exit 0.

    Raises:
        KeyboardInterrupt: "signal N (its first KeyboardInterrupt was lost)".
    """
    if _signalled is not None:
        raise KeyboardInterrupt(f"signal {_signalled} (its first KeyboardInterrupt was lost)")


def delivered() -> int | None:
    """Say that the KeyboardInterrupt of the signal kept (if any) reached code that handles it: later calls of
    `raise_if_signalled` do not raise it again. A later signal is kept anew. Returns the signal it cleared
    (None for none: a Ctrl-C under Python's own handler)."""
    global _signalled
    signum, _signalled = _signalled, None
    return signum


def exit_status() -> int | None:
    """The exit status of a run a KeyboardInterrupt ended: 143 (128 + 15, a shell's status for a process SIGTERM
    ended; what a batch scheduler or a CI runner's timeout reads as "terminated") where the last signal this
    process got was SIGTERM. None where it was SIGINT, or Ctrl-C under Python's own handler: the caller raises
    the KeyboardInterrupt again, and Python's exit ends the process by SIGINT (130 in a shell)."""
    return 128 + signal.SIGTERM if _last == signal.SIGTERM else None


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Hold the first SIGTERM or SIGINT that comes while the block runs, and raise its KeyboardInterrupt once
    the block has ended: for cleanup that must run to its end (a run's `close`: an interrupt in its middle left
    the trainer pools unkilled, and a colocated sender's shared-memory segment in /dev/shm). A second signal
    while one is held raises at once, as without the block: it cuts short the step it lands in (a cleanup
    that seems stuck), and what the block runs in `finally` still runs. Its waits are bounded by their own
    timeouts. Blocks nest (the outer one raises). Where the block fails with another
    error, that error goes on and the held signal is kept as one lost (`raise_if_signalled` raises it at the next
    wait or scenario of a process that goes on).

    Raises:
        KeyboardInterrupt: "signal N (held until the cleanup ended)", after the block, where a signal came.
    """
    global _holding, _held, _signalled
    if _holding:
        yield
        return
    _holding = True
    try:
        yield
    except BaseException as e:
        if _held is not None and not isinstance(e, KeyboardInterrupt):  # a second signal's is the one delivered
            _signalled = _held
        raise
    finally:
        _holding = False
        signum, _held = _held, None
    if signum is not None:
        raise KeyboardInterrupt(f"signal {signum} (held until the cleanup ended)")


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Keep every SIGTERM or SIGINT that comes while the block runs, and deliver them once it has ended, in the
    order they came, as if they had come then (`on_signal`: inside `held`, the first is held, a second raises).
    For a short step that a KeyboardInterrupt must not cut in two, also in a cleanup under `held`: Ray's
    `ray.shutdown` cut just after it shut the driver's core worker down (a second Ctrl-C in a run's close, which
    lands there: the call takes most of the shutdown) left a core worker object whose next use (Ray's own
    `sys.excepthook`, its exit hook) ended the process at once with status 1 and no message (3 of 18 tries).
    Blocks nest (the outer one delivers); outside the main thread, where no handler runs, the block changes
    nothing. Where the block fails with another error, that error goes on, and a signal that would have raised
    is kept as one lost (`raise_if_signalled` raises it at the next wait or scenario of a process that goes on).

    Raises:
        KeyboardInterrupt: "signal N", after the block, where a signal came and is not held (see above).
    """
    global _deferring
    if _deferring or threading.current_thread() is not threading.main_thread():  # only there do handlers run
        yield
        return
    _deferring = True
    failed = True
    try:
        yield
        failed = False
    finally:
        _deferring = False
        signals = list(_deferred)
        _deferred.clear()
        for signum in signals:
            try:
                on_signal(signum, None)
            except KeyboardInterrupt:
                if not failed:
                    raise
                # the block's own error goes on; the signal stays kept as one not yet delivered (`_signalled`)


def last_signal() -> str | None:
    """The name of the last SIGTERM or SIGINT this process got ("SIGTERM", "SIGINT"), None before any."""
    return signal.Signals(_last).name if _last is not None else None


def ended_by() -> str:
    """What ended a run a KeyboardInterrupt ended, for its last line: "SIGTERM", "SIGINT", or "Ctrl-C" (Python's
    own SIGINT handler, where `install` left it)."""
    return last_signal() or "Ctrl-C"


def install() -> None:
    """Make `on_signal` SIGTERM's handler, and SIGINT's unless this process started with SIGINT ignored (a
    shell's background job): there it stays ignored, as Python leaves it."""
    signal.signal(signal.SIGTERM, on_signal)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_signal)


def interrupted_error(e: KeyboardInterrupt, record: RunRecord, signum: int | None) -> ErrorRecord:
    """The runner's error for a scenario interrupted by Ctrl-C or a signal (a CRASH of the runner, unless its
    deadline had already passed: DEADLOCK; never a PASS, and never the verdict it expects,
    `harness.checks.interrupted`): how many syncs it recorded, of the `syncs + 1` it plans
    (`ScenarioSession.run_syncs`: the last re-sends unchanged weights; a recovery sync after a failed one also
    counts), and every trainer rank's last phase, from `RunRecord.progress` (read before this call).
    `signum`: what `delivered` returned, which names the signal where `e` has no text (Ray's waits, `ray.wait`
    and `ray.get`, raise a KeyboardInterrupt of their own, without the handler's text)."""
    what = str(e) or (f"signal {signum}" if signum is not None else "Ctrl-C")
    n = len(record.syncs)
    planned = record.scenario.syncs
    syncs = f"after {n} of {planned + 1} planned syncs ({planned}, then one that re-sends unchanged weights)"
    phases = "; ".join(f"{label}: {phase}" for label, phase in record.progress.items()) or "none recorded"
    return ErrorRecord(
        where="runner",
        type=INTERRUPTED,
        message=f"the run was interrupted ({what}) {syncs}; last phases: {phases}",
        traceback="".join(traceback.format_exception(e))[-8000:],
    )
