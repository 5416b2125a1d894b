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
