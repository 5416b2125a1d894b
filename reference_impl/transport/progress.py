"""Where a rank is in the current step, kept in a small file so a watchdog can say it when the rank hangs.

A rank that waits forever (in a collective, a broadcast, an HTTP call) cannot answer; the harness's
watchdog reads these files instead: each holds one line, the last phase the rank entered, e.g.
"sync 2: chunk 3 of 9 on the wire: /update_weights in flight (transfer)". Each write replaces the file
atomically (temp file, rename); with no path nothing is written.
"""

from __future__ import annotations

import os
from pathlib import Path


class Progress:
    """The last phase one rank entered (see the module doc)."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def at(self, phase: str) -> None:
        """Record that this rank entered `phase` (one line of text)."""
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(phase + "\n")
        os.replace(tmp, self.path)


def read_progress(folder: Path) -> dict[str, str]:
    """label -> last phase, for every `<label>.txt` in `folder` ({} when it does not exist)."""
    if not folder.is_dir():
        return {}
    return {p.stem: p.read_text().strip() for p in sorted(folder.glob("*.txt"))}
