"""POSIX shared-memory segments (`/dev/shm`) that processes hold, and removing those they left.

A process that makes a segment and is killed before it unlinks it (SIGKILL, or a SIGTERM that ends it
before its cleanup runs) leaves the segment in /dev/shm until the host reboots: its bytes stay in memory.
Both the harness (the trainer ranks' channel segments, `harness.shm`) and the engine launchers (vLLM's
own segments, `engine.process.ServerProcess.stop`) therefore note what a process set holds before they
end it, and unlink what is still there after. What a process holds is read from Linux's `/proc`: the
segments it maps (`/proc/<pid>/maps`) or holds open (`/proc/<pid>/fd`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

import psutil

SHM_DIR = Path("/dev/shm")


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


def group_members(pgid: int) -> list[int]:
    """Pids of the live processes in process group `pgid` (its leader among them while it lives; zombies
    left out). Unlike a process tree, a group keeps the children a dead leader left (they are re-parented,
    not regrouped)."""
    members = []
    for pid in psutil.pids():
        with contextlib.suppress(OSError, psutil.Error):
            if os.getpgid(pid) == pgid and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                members.append(pid)
    return members


def held_by_group(pgid: int, root: Path = SHM_DIR) -> set[str]:
    """Names of the segments in `root` that any live process of process group `pgid` maps or holds open."""
    names: set[str] = set()
    for pid in group_members(pgid):
        names |= held_by(pid, root)
    return names


def present(names: Iterable[str], root: Path = SHM_DIR) -> dict[str, int]:
    """name -> bytes, for those of `names` still in `root`."""
    out = {}
    for name in names:
        with contextlib.suppress(OSError):
            out[name] = (root / name).stat().st_size
    return out


def unlink(names: Iterable[str], root: Path = SHM_DIR) -> list[str]:
    """Remove those of `names` still in `root` (a name with a "/" or "", ".", ".." is never touched; one that
    cannot be removed, another user's or a folder, is left); returns the ones removed."""
    removed = []
    for name in names:
        if "/" in name or name in ("", ".", ".."):
            continue
        with contextlib.suppress(OSError):
            (root / name).unlink()
            removed.append(name)
    return removed
