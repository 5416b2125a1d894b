"""The floor tool's view-based QKV split (`harness.scale.bridge_floor.view_split_qkv`) against a layout
derived by hand from megatron-core's fused QKV order: per query group, its query heads, then one K head,
then one V head."""

from __future__ import annotations

import pytest
import torch

from harness.scale.bridge_floor import view_split_qkv


def test_view_split_takes_each_groups_query_heads_then_its_k_and_v() -> None:
    # 4 query heads in 2 groups, head_dim 2, hidden 3: per group (2 + 2) heads x 2 rows = 8 rows, in the order
    # q q k v (heads); 16 rows in all. Row r of the fused weight holds r in every column, so each output
    # names the rows it took.
    qkv = torch.arange(16, dtype=torch.bfloat16)[:, None].expand(16, 3).contiguous()
    q, k, v = view_split_qkv(qkv, num_heads=4, num_query_groups=2, head_dim=2)
    assert q[:, 0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]  # group 0: heads 0-1; group 1: heads 2-3
    assert k[:, 0].tolist() == [4, 5, 12, 13]
    assert v[:, 0].tolist() == [6, 7, 14, 15]
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.shape == (8, 3) and k.shape == v.shape == (4, 3)
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()


def test_view_split_refuses_a_weight_that_does_not_fit_the_heads() -> None:
    with pytest.raises(ValueError, match="does not fit 4 heads in 2 groups"):
        view_split_qkv(torch.zeros(12, 3), num_heads=4, num_query_groups=2, head_dim=2)


def test_header_shapes_read_each_tensors_shape_and_dtype_as_stored(tmp_path) -> None:
    from safetensors.torch import save_file

    from harness.scale.bridge_floor import header_shapes

    save_file(
        {"a.weight": torch.zeros(3, 5, dtype=torch.bfloat16), "b": torch.ones(7, dtype=torch.int64)},
        tmp_path / "m-1.safetensors",
    )
    save_file({"c": torch.zeros(2, 2, 2)}, tmp_path / "m-2.safetensors")
    assert header_shapes(tmp_path) == {
        "a.weight": ((3, 5), torch.bfloat16),
        "b": ((7,), torch.int64),
        "c": ((2, 2, 2), torch.float32),
    }


def test_header_shapes_refuse_a_folder_without_safetensors(tmp_path) -> None:
    from harness.scale.bridge_floor import header_shapes

    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors file"):
        header_shapes(tmp_path)
