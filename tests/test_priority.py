"""`reference_impl.priority`: work in SCHED_IDLE at nice 19 in one thread, read back with procps' `ps -L` (a
second reader of the kernel's per-thread class and nice), and the priority given back after it or raised from
outside."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from reference_impl.priority import (
    LOWEST_NICE,
    can_raise_priority,
    in_lowest_priority_thread,
    lowest_priority,
    raise_threads_to,
)

if not can_raise_priority():  # then every function here leaves priorities as they are, by design
    pytest.skip("this host does not let a thread raise its priority again (no CAP_SYS_NICE)", allow_module_level=True)


def _sched(tid: int) -> str:
    """Thread `tid`'s scheduling class as `ps` reads it and its nice value from `getpriority(2)`: "TS 0"
    (SCHED_OTHER at nice 0), "IDL 19" (SCHED_IDLE at nice 19), ..."""
    out = subprocess.run(["ps", "-L", "-o", "tid=,cls=", "-p", str(os.getpid())], capture_output=True, text=True)
    cls = {int(t): c for t, c in (line.split() for line in out.stdout.splitlines())}[tid]
    return f"{cls} {os.getpriority(os.PRIO_PROCESS, tid)}"


def test_only_the_calling_thread_runs_at_nice_19_and_gets_its_nice_back() -> None:
    seen: dict[str, object] = {}

    def work() -> None:
        tid = threading.get_native_id()
        seen["before"] = _sched(tid)
        with lowest_priority():
            seen["inside"] = _sched(tid)
            seen["main inside"] = _sched(os.getpid())  # the main thread's id is the process id
        seen["after"] = _sched(tid)

    main_before = _sched(os.getpid())
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen["inside"] == f"IDL {LOWEST_NICE}" != seen["before"]
    assert seen["main inside"] == main_before  # per thread: the rest of the process kept its priority
    assert seen["after"] == seen["before"]


def test_work_in_a_lowest_priority_thread_leaves_the_caller_and_hands_back_its_exception() -> None:
    seen: dict[str, object] = {}

    def work() -> None:
        seen["tid"] = threading.get_native_id()
        seen["nice"] = _sched(seen["tid"])
        seen["caller"] = _sched(os.getpid())

    before = _sched(os.getpid())
    in_lowest_priority_thread(work)
    assert seen["tid"] != os.getpid() and seen["nice"] == f"IDL {LOWEST_NICE}" and seen["caller"] == before
    with pytest.raises(KeyError, match="from the thread"):
        in_lowest_priority_thread(lambda: {}["from the thread"])


def test_a_thread_below_a_priority_is_raised_to_it_from_outside() -> None:
    lowered, release = threading.Event(), threading.Event()
    tid: list[int] = []

    def waiting() -> None:
        tid.append(threading.get_native_id())
        with lowest_priority():
            lowered.set()
            release.wait(30)

    thread = threading.Thread(target=waiting)
    thread.start()
    try:
        assert lowered.wait(30) and _sched(tid[0]) == f"IDL {LOWEST_NICE}"
        main = _sched(os.getpid())
        assert raise_threads_to(os.getpid(), os.getpriority(os.PRIO_PROCESS, 0)) == [tid[0]]  # only that thread
        assert _sched(tid[0]) == main
    finally:
        release.set()
        thread.join()
