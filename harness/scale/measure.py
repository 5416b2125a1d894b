"""Measure this host's links for `update_time.Links`: a gloo (TCP) stream between two processes, a
host memory copy, and the fixed cost of a small gloo message. Starts two processes (run it under the
shared heavy-run lock on a shared host).

Method: `torch.distributed` gloo group of two spawned processes on 127.0.0.1; rank 0 sends a uint8
tensor of `nbytes` to rank 1 (`dist.send` / `dist.recv`) `repeats` times, then 1-byte round trips;
medians. The copy is `dst.copy_(src)` of `nbytes` in this process, one thread.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from reference_impl.engine.process import free_port


def _ranks(rank: int, port: int, nbytes: int, repeats: int, out: Any) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    one = torch.zeros(1, dtype=torch.uint8)
    stream, ping = [], []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.send(buf, dst=1) if rank == 0 else dist.recv(buf, src=0)
        dist.barrier()
        stream.append(time.perf_counter() - t0)
    for _ in range(50):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(one, dst=1)
            dist.recv(one, src=1)
        else:
            dist.recv(one, src=0)
            dist.send(one, dst=0)
        ping.append(time.perf_counter() - t0)
    if rank == 0:
        out.put({"tcp_s": statistics.median(stream), "round_trip_s": statistics.median(ping)})
    dist.destroy_process_group()


def memcpy_gbps(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """GB/s of one host copy of `nbytes` (median of `repeats`)."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def measure(nbytes: int = 64 << 20, repeats: int = 5) -> dict[str, float]:
    """{"tcp": GB/s of a gloo stream, "memcpy": GB/s of a host copy, "gloo_round_trip_s": seconds of a
    1-byte round trip, "bytes": nbytes}.

    Raises:
        RuntimeError: a measuring process failed.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_ranks, args=(r, port, nbytes, repeats, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
        if p.exitcode != 0:
            raise RuntimeError(f"a measuring process exited with {p.exitcode}")
    got = out.get(timeout=5)
    return {
        "tcp": nbytes / got["tcp_s"] / 1e9,
        "memcpy": memcpy_gbps(),
        "gloo_round_trip_s": got["round_trip_s"],
        "bytes": float(nbytes),
    }
