"""The transfer group of one sender and several engines: world size, each engine's rank offset, the
`InitInfo` each engine is sent.

The trainer's sender is rank 0 (`protocol.SENDER_RANK`). Engine replica i has `engine_ranks[i]` workers
in the group (its TP workers: vLLM's `--tensor-parallel-size`, the embedded engine's TP ranks), and worker
w of engine i joins as `rank_offset_i + w` (vLLM's `NCCLWeightTransferInitInfo.rank_offset`; its worker
adds its global rank, `nccl_common.py`, as the harness's plugin does in `wsh_vllm_plugin/engine.py`). The
offsets follow each other without gaps: `rank_offset_0 = 1`, `rank_offset_{i+1} = rank_offset_i +
engine_ranks[i]`, and the group holds `1 + sum(engine_ranks)` ranks. Two engines with the same offset
would claim the same ranks and leave others empty: the group never forms.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from wsh_vllm_plugin.protocol import GLOO, SENDER_RANK, InitInfo

from reference_impl.transport.client import EngineClient
from reference_impl.transport.replicas import ReplicaClient, engines_of


def rank_offsets(engine_ranks: Sequence[int]) -> list[int]:
    """Each engine's `rank_offset` in the transfer group (see the module doc). A seam
    (`reference_impl.seams`).

    Raises:
        ValueError: no engine, or an engine with fewer than one rank.
    """
    if not engine_ranks or min(engine_ranks) < 1:
        raise ValueError(f"every engine needs at least one rank in the transfer group: {list(engine_ranks)}")
    offsets, next_rank = [], SENDER_RANK + 1
    for ranks in engine_ranks:
        offsets.append(next_rank)
        next_rank += ranks
    return offsets


def world_size(engine_ranks: Sequence[int]) -> int:
    """Ranks in the transfer group: the sender plus every engine's workers, `1 + sum(engine_ranks)`."""
    return 1 + sum(engine_ranks)


def init_infos(
    master_address: str, master_port: int, engine_ranks: Sequence[int], timeout_s: float, backend: str = GLOO
) -> list[InitInfo]:
    """The `init_info` of /init_weight_transfer_engine for each engine, in engine order: `backend` (a
    `protocol.GROUP_BACKENDS` name: gloo, or nccl on GPU), the
    sender's store at `master_address:master_port`, the engine's `rank_offset` (`rank_offsets`), the group's
    world size, and `timeout_s` (seconds, the join's and every broadcast's)."""
    size = world_size(engine_ranks)
    return [
        InitInfo(
            backend=backend,  # type: ignore[arg-type]  (a GROUP_BACKENDS name)
            master_address=master_address,
            master_port=master_port,
            rank_offset=offset,
            world_size=size,
            timeout_s=timeout_s,
        )
        for offset in rank_offsets(engine_ranks)
    ]


def engine_clients(client: EngineClient | ReplicaClient, engine_ranks: Sequence[int]) -> list[EngineClient]:
    """The engines of `client` (`replicas.engines_of`), one per entry of `engine_ranks` (each engine's workers
    in the group: its TP).

    Raises:
        ValueError: `engine_ranks` does not have one entry per engine.
    """
    clients = engines_of(client)
    if len(engine_ranks) != len(clients):
        raise ValueError(f"{len(clients)} engines but transfer-group ranks for {list(engine_ranks)}")
    return clients


def init_while_joining[J](clients: Sequence[EngineClient], bodies: Sequence[Any], join: Callable[[], J]) -> J:
    """POST /init_weight_transfer_engine `bodies[i]` (an `InitInfo` or vLLM's init_info dict) to engine i,
    each in a thread, while this thread runs `join()` (an engine answers only once every rank of the group
    joined); returns what `join` returned. A failed join does not wait for the HTTP calls.

    Raises:
        EngineRejected: an engine refused the init call.
        What `join` raises (e.g. RuntimeError / DistStoreError when the engines did not join in time).
    """
    pool = ThreadPoolExecutor(max_workers=len(clients), thread_name_prefix="init-transfer")
    try:
        answers = [pool.submit(c.init_transfer, body) for c, body in zip(clients, bodies, strict=True)]
        joined = join()
        for answer in answers:
            answer.result()  # re-raises an init call's error here
    finally:
        pool.shutdown(wait=False)
    return joined
