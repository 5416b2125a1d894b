"""The vocab-parallel fused log-prob kernel of the Megatron forward, against a full-vocabulary log_softmax.

Sharded cases run as real gloo process groups (2 or 3 processes, no Megatron import): each rank holds
a column shard of the same logits, with padding columns past the real vocabulary set to huge values
that would dominate the softmax if they were not dropped.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from reference_impl.forward.logprobs import logprobs_from_logits
from reference_impl.forward.megatron import vocab_parallel_logprobs

T, V_REAL = 37, 250


def full_logits(v_padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, v_padded] logits whose padding columns hold 1e4, and [T] targets in [0, V_REAL)."""
    g = torch.Generator().manual_seed(7)
    logits = 3.0 * torch.randn(T, v_padded, generator=g)
    logits[:, V_REAL:] = 1e4
    targets = torch.randint(0, V_REAL, (T,), generator=g)
    targets[:3] = torch.tensor([0, V_REAL - 1, V_REAL // 2])  # first id, last real id, a shard boundary
    return logits, targets


def expected(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    return logprobs_from_logits(logits[:, :V_REAL], targets, temperature)[0]


@pytest.mark.parametrize("chunk", [1, 5, 256])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.5])
def test_unsharded_matches_log_softmax_and_drops_padding(chunk: int, temperature: float) -> None:
    logits, targets = full_logits(256)
    got = vocab_parallel_logprobs(logits, targets, temperature, 0, V_REAL, None, chunk_tokens=chunk)
    assert got.dtype == torch.float32 and got.shape == (T,)
    assert torch.allclose(got, expected(logits, targets, temperature), atol=1e-5, rtol=0)


def test_bf16_logits_are_upcast_per_chunk() -> None:
    logits, targets = full_logits(256)
    low = logits.to(torch.bfloat16)
    got = vocab_parallel_logprobs(low, targets, 0.7, 0, V_REAL, None, chunk_tokens=8)
    assert got.dtype == torch.float32
    assert torch.allclose(got, expected(low.float(), targets, 0.7), atol=1e-5, rtol=0)


def test_temperature_changes_the_result() -> None:
    logits, targets = full_logits(256)
    a = vocab_parallel_logprobs(logits, targets, 0.7, 0, V_REAL, None)
    b = vocab_parallel_logprobs(logits, targets, 1.0, 0, V_REAL, None)
    assert (a - b).abs().max() > 0.1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"targets": torch.full((T,), V_REAL)}, "targets must lie"),
        ({"targets": torch.zeros(T - 1, dtype=torch.long)}, "targets must be"),
        ({"logits": torch.zeros(1, T, 256)}, "2-D"),
        ({"chunk_tokens": 0}, "chunk_tokens"),
        ({"vocab_start": -1}, "vocab_start"),
    ],
)
def test_bad_inputs_are_refused(kwargs: dict, match: str) -> None:
    logits, targets = full_logits(256)
    args = {"logits": logits, "targets": targets, "temperature": 1.0, "vocab_start": 0, "vocab_size": V_REAL}
    with pytest.raises(ValueError, match=match):
        vocab_parallel_logprobs(**{**args, "group": None, **kwargs})


def _shard_rank(rank: int, world: int, port: int, v_padded: int, temperature: float, out: mp.Queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        logits, targets = full_logits(v_padded)
        v_local = v_padded // world
        shard = logits[:, rank * v_local : (rank + 1) * v_local].contiguous()
        got = vocab_parallel_logprobs(shard, targets, temperature, rank * v_local, V_REAL, dist.group.WORLD, 4)
        # A list, not the tensor: torch shares a tensor's storage through a file descriptor that the
        # receiver fetches from this process, which may have exited by then.
        out.put((rank, got.tolist()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("world", "v_padded"),
    [
        (2, 256),  # the padding (250..255) lies in the last shard
        (3, 384),  # shards of 128 columns: the last one (256..383) is padding only
    ],
)
def test_sharded_over_gloo_matches_the_full_vocabulary(world: int, v_padded: int) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # its port, held: no race
    port = store.port
    procs = [ctx.Process(target=_shard_rank, args=(r, world, port, v_padded, 0.7, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    logits, targets = full_logits(v_padded)
    want = expected(logits, targets, 0.7)
    for rank in range(world):
        assert torch.allclose(torch.tensor(results[rank]), want, atol=1e-5, rtol=0), rank
