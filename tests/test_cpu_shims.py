"""The vision attention that stands in for megatron-core's DotProductAttention on packed sequences:
softmax attention within each packed segment, checked against explicit matmuls per segment."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from reference_impl.trainer.cpu_shims import PackedVisionAttention


def attention_by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q/k/v [L, n, d] (same head count) -> [L, n * d], non-causal softmax attention, float64."""
    scores = torch.einsum("qnd,knd->nqk", q.double(), k.double()) * scale
    out = torch.einsum("nqk,knd->qnd", scores.softmax(-1), v.double())
    return out.reshape(q.shape[0], -1).float()


def make(d: int = 32, softmax_scale: float | None = None) -> PackedVisionAttention:
    return PackedVisionAttention(SimpleNamespace(kv_channels=d), 1, "AttnMaskType.no_mask", softmax_scale=softmax_scale)


def qkv(t: int, nq: int = 2, nkv: int = 2, d: int = 32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    return tuple(torch.randn(t, n, d, generator=g) for n in (nq, nkv, nkv))


def test_packed_segments_attend_only_within_themselves() -> None:
    q, k, v = qkv(10)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    got = make()(q, k, v, None, packed_seq_params=SimpleNamespace(cu_seqlens_q=cu))
    scale = 32**-0.5
    want = torch.cat([attention_by_hand(q[:4], k[:4], v[:4], scale), attention_by_hand(q[4:], k[4:], v[4:], scale)])
    assert got.shape == (10, 64)
    assert torch.allclose(got, want, atol=1e-5)
    # one segment over everything differs: the segments really are kept apart
    whole = make()(q, k, v, None, packed_seq_params=SimpleNamespace(cu_seqlens_q=torch.tensor([0, 10])))
    assert not torch.allclose(whole, want, atol=1e-3)


def test_unpacked_batch_rows_and_grouped_keys() -> None:
    q, k, v = qkv(6, nq=4, nkv=2)
    got = make(softmax_scale=0.25)(q[:, None], k[:, None], v[:, None], None)
    want = attention_by_hand(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), 0.25)
    assert got.shape == (6, 1, 128)
    assert torch.allclose(got[:, 0], want, atol=1e-5)


def test_causal_masks_and_biases_are_refused() -> None:
    with pytest.raises(ValueError, match="non-causal"):
        PackedVisionAttention(SimpleNamespace(kv_channels=32), 1, "AttnMaskType.causal")
    q, k, v = qkv(4)
    with pytest.raises(ValueError, match="no attention mask"):
        make()(q, k, v, torch.ones(1, 1, 4, 4, dtype=torch.bool))
