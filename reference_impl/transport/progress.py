"""Where a rank is in the current step, kept in a small file so a watchdog can say it when the rank hangs.

A rank that waits forever (in a collective, a broadcast, an HTTP call) cannot answer; the harness's
watchdog reads these files instead: each holds one line, the last phase the rank entered, e.g.
"sync 2: chunk 3 of 9 on the wire: /update_weights in flight (transfer)". A rank whose sync runs in two
threads (the sender's export and its send thread, `transport.sync`) keeps one line per thread, the
main thread's first, each other line prefixed with its thread's name. Each write replaces the file
atomically (temp file, rename, under a lock); with no path nothing is written.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


class Progress:
    """The last phase one rank entered (see the module doc)."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self.lines: dict[str, str] = {}  # thread name -> its last phase, main thread first
        self.lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def at(self, phase: str) -> None:
        """Record that this rank (the calling thread of it) entered `phase` (one line of text)."""
        if self.path is None:
            return
        thread = threading.current_thread()
        main = thread is threading.main_thread()
        with self.lock:
            if main:
                self.lines = {"": phase, **{k: v for k, v in self.lines.items() if k}}
            else:
                self.lines[thread.name] = f"{thread.name}: {phase}"
            self._write()

    def ended(self, thread_prefix: str) -> None:
        """Threads whose names begin with `thread_prefix` have ended: their lines go (a finished send
        thread's last phase must not be quoted when the rank later hangs elsewhere)."""
        if self.path is None:
            return
        with self.lock:
            self.lines = {k: v for k, v in self.lines.items() if not k or not k.startswith(thread_prefix)}
            self._write()

    def _write(self) -> None:
        assert self.path is not None
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("\n".join(self.lines.values()) + "\n")
        os.replace(tmp, self.path)


def read_progress(folder: Path) -> dict[str, str]:
    """label -> last phase, for every `<label>.txt` in `folder` ({} when it does not exist); a rank with
    one line per thread gets them on one line, joined by " | " (messages quote it whole)."""
    if not folder.is_dir():
        return {}
    return {
        p.stem: " | ".join(x.strip() for x in p.read_text().splitlines() if x.strip())
        for p in sorted(folder.glob("*.txt"))
    }
