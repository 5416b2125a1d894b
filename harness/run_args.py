"""A run's command-line inputs that name places, checked before anything starts: the results folder and run id
(`python -m harness run|faults|soak --results-dir DIR --run-id ID`), and the Ray cluster to join
(`--ray-address`). Each bad one gets a sentence that says what to change (`harness.cli.main` prints it and
exits 2)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

EARLIER_RUN = ("summary.csv", "env.json", "records")  # what a run writes into its folder


def results_folder(results_dir: Path, run_id: str | None) -> str:
    """The run id a run writes `results_dir/<run id>/` under: `run_id`, or (for none or an empty one) a timestamp
    (`20261206-182348`, then `-2`, `-3`, ... where a run of the same second is there). Nothing recorded is
    overwritten: a folder that holds an earlier run (its summary.csv, env.json or records/) is refused, not
    mixed with the new one.

    Raises:
        ValueError: `results_dir` is a file; `run_id` is no folder name (`.`, `..`, or with a `/`: the
            folder would land outside `results_dir`); `results_dir/run_id` holds an earlier run.
    """
    if results_dir.exists() and not results_dir.is_dir():
        raise ValueError(f"--results-dir {results_dir} is a file: pass a folder (made where missing)")
    if not run_id:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        n, run_id = 1, stamp
        while any((results_dir / run_id / name).exists() for name in EARLIER_RUN):
            n += 1
            run_id = f"{stamp}-{n}"
        return run_id
    if run_id in (".", "..") or "/" in run_id or os.sep in run_id:
        raise ValueError(f"--run-id {run_id!r} is no folder name: use one without '/' (its folder is in --results-dir)")
    earlier = [name for name in EARLIER_RUN if (results_dir / run_id / name).exists()]
    if earlier:
        raise ValueError(
            f"{results_dir / run_id} holds an earlier run ({', '.join(earlier)}): pick another --run-id, or move that "
            "folder away"
        )
    return run_id


def ray_address_problem(address: str) -> str | None:
    """None where `--ray-address` can be a Ray cluster to join: `auto`, `local`, a `ray://` client address, or a
    host:port (a head's GCS server) at which something accepts a TCP connection within 5 s; else a sentence
    that says what to change. Ray itself retried an address where nothing listens every 30 s, without end."""
    if address in ("auto", "local") or "://" in address:
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        return f"--ray-address {address!r} is no host:port of a Ray head (e.g. 127.0.0.1:6379), auto or ray://host:port"
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        return (
            f"nothing answers at --ray-address {address} ({e.strerror or e}): start Ray there "
            f"(`ray start --head --port {port}`), or leave --ray-address out to start one"
        )
    return None
