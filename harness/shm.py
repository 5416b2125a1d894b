"""POSIX shared memory on this host (`/dev/shm`): what is there, what a scenario's processes hold, and
removing what killed processes left.

A colocated sender makes one segment and unlinks it when its channel closes; a rank that is killed first
(a pool ended by `ray.kill`, which also ends the rank's children, its Python resource tracker among them)
never does, and the segment stays in /dev/shm until the host reboots. The harness therefore notes which
segments the rank processes hold (mapped, or open by descriptor, read from `/proc`) before it kills them,
and unlinks those still there once the processes are gone (`TrainerPool.kill`); the runner also unlinks
those the scenario's processes held at any resource sample, or when the sender connected (its channel's
first segment), once its pool is gone (a segment closed but never unlinked is no longer held at the
kill). A sender's segment names carry its pid (`protocol.shm_maker_prefix`): a segment a rank made after the
last look and before its end, held by nobody once the rank is gone, is still found (`made_by`). Only segments
held or made by the scenario's own local processes are ever touched: the host's /dev/shm is shared with every
other program on it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

import psutil

from harness.record import ResourceSample
from reference_impl.shm_segments import SHM_DIR, held_by, held_by_tree, present, unlink

__all__ = ["SHM_DIR", "held_by", "held_by_tree", "held_in", "host_usage", "left_by", "made_by", "present", "unlink"]


def host_usage(root: Path = SHM_DIR) -> tuple[int, int]:
    """(segments, bytes) in `root`: its regular files and their apparent sizes. (0, 0) without `root`."""
    count = total = 0
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return 0, 0
    for entry in entries:
        with contextlib.suppress(FileNotFoundError):  # unlinked while we looked
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
                count += 1
    return count, total


def held_in(samples: Iterable[ResourceSample]) -> set[str]:
    """Names of every segment a scenario's processes held at one of its resource samples."""
    return {name for s in samples for p in s.processes.values() for name in p.shm}


def made_by(pids: Iterable[int], root: Path = SHM_DIR) -> set[str]:
    """Names of the colocate chunk segments in `root` that processes `pids` made (the name starts with
    `protocol.shm_maker_prefix(pid)`: `transport.handles.SharedMemoryBuffer`), whether anything still holds
    them or not. Only ask once those processes are gone: a pid is reused once its process ended."""
    # here, not at the top: the protocol imports torch, and an engine actor imports this module without it
    from wsh_vllm_plugin.protocol import shm_maker_prefix

    prefixes = tuple(shm_maker_prefix(pid) for pid in pids)
    if not prefixes:
        return set()
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return set()
    return {name for name in names if name.startswith(prefixes)}


def _ended(pid: int) -> bool:
    """Whether process `pid` has ended (gone, or a zombie not reaped yet), so that no other process holds `pid`."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def left_by(pids: Iterable[int], root: Path = SHM_DIR) -> set[str]:
    """`made_by` of those of `pids` whose process has ended (gone, or a zombie): what they left in `root`. A pid
    whose process still runs is left out, whether it is the maker still at work or a process that took the pid
    over once the maker ended."""
    return made_by((pid for pid in pids if _ended(pid)), root)
