"""The chunk plan and the packed wire format."""

from __future__ import annotations

import pytest
import torch
from wsh_vllm_plugin.protocol import pack, unpack

from reference_impl.transport.plan import TensorMeta, plan_chunks


def metas(*sizes: int, owner: int = 0) -> list[TensorMeta]:
    return [TensorMeta(f"t{i}", (s,), "uint8", s, owner) for i, s in enumerate(sizes)]


def test_greedy_plan_closes_before_overflow() -> None:
    plan = plan_chunks(metas(40, 50, 20, 100, 5), chunk_bytes=100)
    # 40+50 = 90 fits, +20 would be 110 -> close; 20 alone then +100 overflows; 100 alone; 5.
    assert [[t.name for t in c.tensors] for c in plan] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
    assert [c.nbytes for c in plan] == [90, 20, 100, 5]
    assert [c.index for c in plan] == [0, 1, 2, 3]


def test_tensor_larger_than_a_chunk_travels_alone() -> None:
    plan = plan_chunks(metas(10, 500, 10), chunk_bytes=100)
    assert [[t.name for t in c.tensors] for c in plan] == [["t0"], ["t1"], ["t2"]]


@pytest.mark.parametrize(("bucket", "expected_chunks"), [(1, 5), (10**12, 1)])
def test_one_tensor_per_chunk_and_whole_model(bucket: int, expected_chunks: int) -> None:
    plan = plan_chunks(metas(3, 4, 5, 6, 7), chunk_bytes=bucket)
    assert len(plan) == expected_chunks
    assert [t.name for c in plan for t in c.tensors] == [f"t{i}" for i in range(5)]


def test_plan_keeps_owner_order_and_reports_owners() -> None:
    tensors = [*metas(10, 10, owner=0), TensorMeta("s1", (10,), "uint8", 10, 2)]
    plan = plan_chunks(tensors, chunk_bytes=25)
    assert [c.owners() for c in plan] == [{0}, {2}]


def test_plan_rejects_a_name_owned_twice() -> None:
    dup = [TensorMeta("w", (1,), "uint8", 1, 0), TensorMeta("w", (1,), "uint8", 1, 2)]
    with pytest.raises(ValueError, match="named by ranks 0 and 2"):
        plan_chunks(dup, chunk_bytes=10)


def test_plan_rejects_zero_chunk_bytes() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        plan_chunks(metas(1), chunk_bytes=0)


def test_pack_unpack_round_trip_with_misaligned_offsets() -> None:
    a = torch.arange(3, dtype=torch.bfloat16)  # 6 bytes: the fp32 after it starts at offset 6
    b = torch.randn(2, 3)
    buf = pack([a, b])
    assert buf.dtype == torch.uint8 and buf.numel() == 6 + 24
    x, y = unpack(buf, [torch.bfloat16, torch.float32], [[3], [2, 3]])
    assert torch.equal(x, a) and torch.equal(y, b)


def test_unpack_rejects_wrong_byte_count() -> None:
    buf = pack([torch.zeros(4)])  # 16 bytes of fp32 declared as bf16 (8 bytes)
    with pytest.raises(ValueError, match="16 bytes but its declared dtypes/shapes need 8"):
        unpack(buf, [torch.bfloat16], [[4]])
