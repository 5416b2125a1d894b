"""POSIX shared memory on this host (`/dev/shm`): what is there, what a scenario's processes hold, and
removing what killed processes left.

A colocated sender makes one segment and unlinks it when its channel closes; a rank that is killed first
(a pool ended by `ray.kill`, which also ends the rank's children, its Python resource tracker among them)
never does, and the segment stays in /dev/shm until the host reboots. The harness therefore notes which
segments the rank processes hold (mapped, or open by descriptor, read from `/proc`) before it kills them,
and unlinks those still there once the processes are gone (`TrainerPool.kill`); the runner also unlinks
those the scenario's processes held at any resource sample, or when the sender connected (its channel's
first segment), once its pool is gone (a segment closed but never unlinked is no longer held at the
kill). Only segments held by the scenario's own local processes are ever touched: the host's /dev/shm is
shared with every other program on it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

import psutil

from harness.record import ResourceSample

SHM_DIR = Path("/dev/shm")


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


def held_by(pid: int, root: Path = SHM_DIR) -> set[str]:
    """Names of the segments in `root` that process `pid` maps or holds open (Linux `/proc/<pid>/maps` and
    `/proc/<pid>/fd`), leaving out those already unlinked; empty when the process is gone or unreadable."""
    prefix = str(root) + "/"
    names: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
            path = fields[5] if len(fields) == 6 else ""
            if path.startswith(prefix) and not path.endswith(" (deleted)"):  # e.g. Ray's object store: unlinked
                names.add(path[len(prefix) :])
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix) and not target.endswith(" (deleted)"):
                    names.add(target[len(prefix) :])
    return names


def held_by_tree(pids: Iterable[int | None], root: Path = SHM_DIR) -> set[str]:
    """Names of the segments in `root` that processes `pids` (None skipped) or any of their descendants map
    or hold open (`held_by`); a process that is gone or ends while it is read is left out."""
    names: set[str] = set()
    for pid in pids:
        if pid is None:
            continue
        try:
            root_proc = psutil.Process(pid)
            tree = [root_proc, *root_proc.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in tree:
            names |= held_by(proc.pid, root)
    return names


def held_in(samples: Iterable[ResourceSample]) -> set[str]:
    """Names of every segment a scenario's processes held at one of its resource samples."""
    return {name for s in samples for p in s.processes.values() for name in p.shm}


def present(names: Iterable[str], root: Path = SHM_DIR) -> dict[str, int]:
    """name -> bytes, for those of `names` still in `root`."""
    out = {}
    for name in names:
        with contextlib.suppress(OSError):
            out[name] = (root / name).stat().st_size
    return out


def unlink(names: Iterable[str], root: Path = SHM_DIR) -> list[str]:
    """Remove those of `names` still in `root`; returns the ones removed."""
    removed = []
    for name in names:
        if "/" in name or name in ("", ".", ".."):
            continue
        with contextlib.suppress(FileNotFoundError):
            (root / name).unlink()
            removed.append(name)
    return removed
