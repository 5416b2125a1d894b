"""A fixed micro-benchmark of the host, measured at the start of every run and kept in env.json.

Two runs on different hosts (or on one host at different times) differ in speed for reasons that are
not the code's. A regression report (`harness.report`) divides each run's times by what this benchmark
measured in that run, so what is left is what the host cannot explain. It measures the two ways a
chunk's bytes travel on the harness's data path:

- ``memcpy_gbps``: a copy of `NBYTES` bytes into a reused buffer (numpy ``copyto``, one thread), what
  a colocated chunk costs (packed into a reused shared-memory segment);
- ``gloo_broadcast_gbps``: a broadcast of `NBYTES` bytes over a 2-rank gloo group on loopback, built
  as the transfer group is (`ProcessGroupGloo` on a store, default device; both ranks in this process,
  one thread each), what a non-colocated chunk costs.

Each is the median over `REPEATS` timed repeats after one warm-up, in GB/s (1e9 bytes per second).
The whole measurement takes well under a few seconds; nothing is left running.
"""

from __future__ import annotations

import datetime
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

NBYTES = 64 << 20  # 64 MiB: large enough that per-call overheads do not dominate, small enough to be quick
REPEATS = 5
GLOO_TIMEOUT_S = 30.0


def _median_gbps(step: Callable[[], None], nbytes: int, repeats: int) -> float:
    step()  # warm-up: first-touch page faults, connection set-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def memcpy_gbps(nbytes: int = NBYTES, repeats: int = REPEATS) -> float:
    """GB/s of copying `nbytes` (uint8) into a reused buffer, median of `repeats` after one warm-up."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return _median_gbps(lambda: np.copyto(dst, src), nbytes, repeats)


def gloo_broadcast_gbps(nbytes: int = NBYTES, repeats: int = REPEATS) -> float:
    """GB/s of broadcasting `nbytes` (uint8) from rank 0 to rank 1 of a 2-rank gloo group on loopback,
    median of `repeats` after one warm-up (rank 0's timings).

    Raises:
        RuntimeError: the group did not form or a broadcast failed within `GLOO_TIMEOUT_S` seconds, or
            rank 1 did not receive rank 0's bytes.
    """
    import torch
    import torch.distributed as dist

    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=GLOO_TIMEOUT_S)
    result: dict[int, Any] = {}

    def rank(r: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(store, r, 2, timeout)
            buf = torch.full((nbytes,), 7 if r == 0 else 0, dtype=torch.uint8)
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            result[r] = _median_gbps(lambda: pg.broadcast([buf], opts).wait(), nbytes, repeats)
            if r == 1 and int(buf[-1]) != 7:
                raise RuntimeError("rank 1 did not receive rank 0's bytes")
        except Exception as e:  # handed to the caller below
            result[r] = e

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(GLOO_TIMEOUT_S * (repeats + 2))
    for r in (0, 1):
        outcome = result.get(r, RuntimeError(f"rank {r} did not finish"))
        if isinstance(outcome, Exception):
            raise RuntimeError(f"gloo broadcast calibration failed on rank {r}: {outcome}") from outcome
    return float(result[0])


def calibrate(nbytes: int = NBYTES, repeats: int = REPEATS) -> dict[str, Any]:
    """Both measurements as env.json's ``calibration``: ``memcpy_gbps``, ``gloo_broadcast_gbps`` (None
    with ``error`` set when the gloo group cannot be formed here), ``bytes``, ``repeats`` and ``seconds``
    (what measuring took). Never raises."""
    t0 = time.perf_counter()
    out: dict[str, Any] = {"bytes": nbytes, "repeats": repeats}
    out["memcpy_gbps"] = memcpy_gbps(nbytes, repeats)
    try:
        out["gloo_broadcast_gbps"] = gloo_broadcast_gbps(nbytes, repeats)
    except Exception as e:  # a host without loopback gloo still gets a run; the report then uses memcpy
        out["gloo_broadcast_gbps"] = None
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.perf_counter() - t0
    return out
