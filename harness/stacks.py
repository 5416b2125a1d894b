"""Python stacks of a scenario's processes when it passes its deadline (`py-spy dump`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def dump_stacks(pids: dict[str, int | None], out_dir: Path, timeout_s: float = 30.0) -> list[str]:
    """Python stacks of every process in `pids` (label -> pid) into `out_dir/<label>.txt` with
    `py-spy dump --subprocesses` (vLLM's server has its engine core as a child, and worker processes at TP > 1
    or on GPU); returns the files written. A process py-spy cannot read gets its error in the file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    files = []
    for label, pid in pids.items():
        if pid is None:
            continue
        try:
            proc = subprocess.run(
                [py_spy, "dump", "--subprocesses", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s
            )
            text = proc.stdout + (f"\n[py-spy exit {proc.returncode}] {proc.stderr}" if proc.returncode else "")
        except (OSError, subprocess.TimeoutExpired) as e:
            text = f"py-spy dump --pid {pid} failed: {e}"
        path = out_dir / f"{label}.txt"
        path.write_text(f"# {label} pid {pid}\n{text}")
        files.append(str(path))
    return files
