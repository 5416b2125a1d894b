"""Work done ahead of need at the lowest CPU priority, so that it only takes CPU nothing else wants.

Lowest is Linux's SCHED_IDLE policy at nice 19 (`sched(7)`): a SCHED_IDLE thread weighs about 1/12 of a nice-19
thread, so it yields even to Ray's workers, which Ray starts at nice 15 (its `worker_niceness`); nice alone
would not (a nice-19 thread still gets about 30% of a CPU beside one nice-15 thread).

Linux keeps a nice value per thread (`setpriority(PRIO_PROCESS, 0, ...)` and `nice(2)` change the calling
thread only; `sched(7)`, "The nice value"), so a process can run one piece of work at nice 19 and go back to its
own priority afterwards, where it may raise its priority again: root with CAP_SYS_NICE, or an RLIMIT_NICE
soft limit of at least 20 - its nice (`getrlimit(2)`); the same lets it leave SCHED_IDLE for SCHED_OTHER again.
Both are per thread, and a child process starts with its parent thread's.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator

import psutil

LOWEST_NICE = 19


def can_raise_priority() -> bool:
    """Whether the calling thread may lower its nice value again after raising it (tried one step up and back;
    where the way back is refused, the thread stays one step lower than it was)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    if before >= LOWEST_NICE:
        return False
    os.setpriority(os.PRIO_PROCESS, 0, before + 1)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, before)
    except PermissionError:
        return False
    return True


@contextlib.contextmanager
def lowest_priority() -> Iterator[bool]:
    """Run the block with the calling thread in SCHED_IDLE at nice 19 and give it back its policy (SCHED_OTHER)
    and nice afterwards; yields whether the priority was lowered (only a SCHED_OTHER thread where
    `can_raise_priority`; else the block runs at the thread's own)."""
    before, policy = os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0)
    lowered = policy == os.SCHED_OTHER and can_raise_priority()
    if lowered:
        os.setpriority(os.PRIO_PROCESS, 0, LOWEST_NICE)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    try:
        yield lowered
    finally:
        if lowered:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, 0, before)


def in_lowest_priority_thread(work: Callable[[], None]) -> None:
    """Run `work` in a new thread at the lowest priority (`lowest_priority`) and wait for it; the calling thread
    keeps its own priority, so a process's main thread never runs below its usual priority. Re-raises what
    `work` raised."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            with lowest_priority():
                work()
        except BaseException as e:  # handed to the caller
            failed.append(e)

    thread = threading.Thread(target=run, name="lowest-priority")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def raise_threads_to(pid: int, nice: int) -> list[int]:
    """Give every thread of process `pid` that runs in SCHED_IDLE or at a lower priority than `nice` (a higher
    nice value) SCHED_OTHER at nice value `nice`; returns their thread ids. A thread that ends meanwhile, or
    that this process may not change (`can_raise_priority`), is left as it is; a process that has ended has
    none. On Linux, `getpriority(PRIO_PROCESS, tid)` reads one thread's nice."""
    raised = []
    with contextlib.suppress(psutil.Error):
        for thread in psutil.Process(pid).threads():
            with contextlib.suppress(OSError):
                idle = os.sched_getscheduler(thread.id) == os.SCHED_IDLE
                if idle or os.getpriority(os.PRIO_PROCESS, thread.id) > nice:
                    if idle:
                        os.sched_setscheduler(thread.id, os.SCHED_OTHER, os.sched_param(0))
                    os.setpriority(os.PRIO_PROCESS, thread.id, nice)
                    raised.append(thread.id)
    return raised
