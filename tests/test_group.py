"""The transfer group of one sender and several engine replicas: rank offsets, world size, init infos."""

from __future__ import annotations

import pytest

from reference_impl.transport import group


@pytest.mark.parametrize(
    ("engine_ranks", "offsets", "world"),
    [([1], [1], 2), ([2], [1], 3), ([1, 1], [1, 2], 3), ([2, 2], [1, 3], 5), ([1, 3, 2], [1, 2, 5], 7)],
)
def test_every_engine_worker_gets_its_own_rank(engine_ranks: list[int], offsets: list[int], world: int) -> None:
    assert group.rank_offsets(engine_ranks) == offsets
    assert group.world_size(engine_ranks) == world
    # every rank of the group is taken exactly once: the sender's 0, then each engine worker's offset + w
    taken = [0] + [o + w for o, n in zip(offsets, engine_ranks, strict=True) for w in range(n)]
    assert sorted(taken) == list(range(world))


def test_init_infos_carry_each_engines_offset_and_the_groups_size() -> None:
    infos = group.init_infos("192.0.2.2", 29500, [2, 2], 30.0)
    assert [(i.rank_offset, i.world_size, i.master_address, i.master_port) for i in infos] == [
        (1, 5, "192.0.2.2", 29500),
        (3, 5, "192.0.2.2", 29500),
    ]
    for info in infos:
        info.check()  # a valid gloo init_info, offset inside the group


@pytest.mark.parametrize("engine_ranks", [[], [0], [1, 0]])
def test_an_engine_without_ranks_is_refused(engine_ranks: list[int]) -> None:
    with pytest.raises(ValueError, match="at least one rank"):
        group.rank_offsets(engine_ranks)


def _join_all(infos, engine_ranks: list[int], timeout_s: float) -> tuple[object, list]:
    """Every engine worker joins (each in a thread, at its init_info's offset + its rank) while this thread
    joins as the sender; returns (the sender's group, futures of each worker's group)."""
    from concurrent.futures import ThreadPoolExecutor

    from wsh_vllm_plugin.group import join_transfer_group

    pool = ThreadPoolExecutor(max_workers=sum(engine_ranks))
    futures = [
        pool.submit(join_transfer_group, i.master_address, i.master_port, i.rank_offset + w, i.world_size, timeout_s)
        for i, n in zip(infos, engine_ranks, strict=True)
        for w in range(n)
    ]
    pool.shutdown(wait=False)
    return futures, pool


def test_one_broadcast_reaches_every_worker_of_every_engine() -> None:
    import torch
    from wsh_vllm_plugin.group import host_store, join_transfer_group

    ranks = [2, 1]
    store = host_store(timeout_s=30)
    infos = group.init_infos("127.0.0.1", store.port, ranks, 30.0)
    futures, _ = _join_all(infos, ranks, 30.0)
    sender = join_transfer_group("127.0.0.1", store.port, 0, group.world_size(ranks), 30.0, store=store)
    workers = [f.result(timeout=60) for f in futures]
    assert sorted(w.rank for w in workers) == [1, 2, 3]
    payload = torch.arange(7, dtype=torch.uint8)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=3) as pool:
        got = [pool.submit(w.receive_chunk, 0) for w in workers]
        sender.send_chunk(payload)
        assert all(torch.equal(g.result(timeout=60), payload) for g in got)


def test_two_engines_with_one_offset_never_form_the_group() -> None:
    """What the fault `duplicate_rank_offsets` does: both engines claim rank 1, rank 2 stays empty, and
    nobody's join returns before the timeout."""
    from wsh_vllm_plugin.group import host_store, join_transfer_group

    from harness.faults import trainer as trainer_faults
    from reference_impl import seams

    try:
        trainer_faults.duplicate_rank_offsets()
        store = host_store(timeout_s=5)
        infos = group.init_infos("127.0.0.1", store.port, [1, 1], 5.0)
    finally:
        seams.restore_all()
    assert [i.rank_offset for i in infos] == [1, 1]
    futures, _ = _join_all(infos, [1, 1], 5.0)
    with pytest.raises(Exception, match=r"(?i)timeout|timed out|wait"):
        join_transfer_group("127.0.0.1", store.port, 0, 3, 5.0, store=store)
    for f in futures:
        assert f.exception(timeout=60) is not None
