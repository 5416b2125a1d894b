"""Parameter iteration for the weight sync: global Megatron names and TP gather.

- PP: a stage numbers its transformer layers locally (`decoder.layers.0` is the stage's first layer);
  the global index is read from the layer module's `layer_number` (1-based, offset applied by
  Megatron), so `global = local + layer offset` without recomputing Megatron's offset rule.
- TP: a parameter with `tensor_model_parallel=True` is split along `partition_dim`; with
  `partition_stride` s > 1 (e.g. `mlp.linear_fc1`, stride 2) each shard holds s interleaved blocks
  ([gate_r; up_r]) and the full tensor is [gate_0..gate_{n-1}; up_0..up_{n-1}].
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import torch.distributed as dist

_LAYER_RE = re.compile(r"^(?P<prefix>.*?decoder\.layers\.)(?P<idx>\d+)(?P<rest>\..*)$")


def layer_offsets(module: torch.nn.Module) -> dict[str, int]:
    """Map each `...decoder.layers.<local>` module path to its global 0-based layer index."""
    out: dict[str, int] = {}
    for name, mod in module.named_modules():
        m = _LAYER_RE.match(name + ".")
        if m and m.group("rest") == "." and hasattr(mod, "layer_number"):
            out[name] = int(mod.layer_number) - 1
    return out


def global_name(local_name: str, offsets: dict[str, int]) -> str:
    """`decoder.layers.0.mlp...` on the second of two stages of 4 layers -> `decoder.layers.2.mlp...`."""
    m = _LAYER_RE.match(local_name)
    if not m:
        return local_name
    key = m.group("prefix") + m.group("idx")
    if key not in offsets:
        return local_name
    return f"{m.group('prefix')}{offsets[key]}{m.group('rest')}"


_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.local_experts\.)(?P<idx>\d+)(?P<rest>\..*)$")


def is_expert_param(name: str) -> bool:
    """A routed expert's parameter (`...mlp.experts.local_experts.K...`)."""
    return _EXPERT_RE.match(name) is not None


def expert_id(name: str) -> int:
    """The expert index K in `...local_experts.K...`.

    Raises:
        ValueError: `name` is not an expert parameter.
    """
    m = _EXPERT_RE.match(name)
    if not m:
        raise ValueError(f"{name} is not a routed expert's parameter")
    return int(m.group("idx"))


def with_expert_id(name: str, idx: int) -> str:
    """`name` with its expert index replaced by `idx` (unchanged when not an expert parameter)."""
    m = _EXPERT_RE.match(name)
    return f"{m.group('prefix')}{idx}{m.group('rest')}" if m else name


def global_expert_name(name: str, ep_rank: int, num_local_experts: int) -> str:
    """`local_experts.K` -> `local_experts.G` with G = ep_rank * num_local_experts + K (global expert id)."""
    if not is_expert_param(name):
        return name
    return with_expert_id(name, ep_rank * num_local_experts + expert_id(name))


def iter_global_params(
    chunks: list[torch.nn.Module], ep_rank: int = 0, num_local_experts: int = 0
) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(global Megatron name, local parameter) for every parameter of this rank's model chunks.

    Global = PP layer offset applied and, with `num_local_experts`, local expert ids turned into global
    ones (`ep_rank * num_local_experts + K`). Wrappers (`Float16Module` in bf16/fp16, DDP) are looked
    through: names never carry `module.`.
    """
    for chunk in chunks:
        while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
            chunk = chunk.module
        offsets = layer_offsets(chunk)
        for name, p in chunk.named_parameters():
            gname = global_name(name, offsets)
            if num_local_experts:
                gname = global_expert_name(gname, ep_rank, num_local_experts)
            yield gname, p


class GatherBuffers:
    """The export's gather outputs, kept by one trainer rank from one export to the next.

    A TP or EP gather writes a parameter's full bytes into memory; a new allocation per parameter and export
    costs a page fault per 4 KiB page the collective writes, every sync (on this CPU host the faults of a
    1.2 GB export took the gather from 0.9 s to 2.5-3.5 s once the host had run a while: measured per thread
    in the kernel). A GPU trainer does not pay this (CUDA's caching allocator keeps freed blocks), so the
    export keeps its buffers as that allocator would: one per (parameter, purpose) for the tensors it hands on,
    and one scratch buffer, grown as needed, for what is consumed at once (the intermediate of a strided
    layout, a non-owner's all-gather output).

    A buffer is rewritten by the next export that uses the same key: an export must be consumed (sent,
    checksummed) before the next export of the same rank starts, and nothing keeps its tensors past that.
    Memory: the bytes of the tensors this rank's exports hand on (all of the model on the stage leader),
    plus the largest scratch use, for the whole run: on a host, where the page faults cost more than the
    memory; not on a GPU, where it would be device memory the training step needs (`kept_gather_buffers`).
    """

    def __init__(self) -> None:
        self._kept: dict[tuple[str, str], torch.Tensor] = {}
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def kept(self, key: tuple[str, str], numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The flat buffer of `numel` elements of `dtype` kept under `key` (made on first use or when the
        size or dtype changed)."""
        buf = self._kept.get(key)
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            self._kept.pop(key, None)
            buf = self._kept[key] = torch.empty(numel, dtype=dtype)
        return buf

    def scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer of `numel` elements of `dtype` that the next `scratch` call overwrites."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(0, dtype=torch.uint8)  # freed before the larger one is made
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes].view(dtype)

    @property
    def nbytes(self) -> int:
        """Bytes held (kept buffers and scratch)."""
        return self._scratch.numel() + sum(b.numel() * b.element_size() for b in self._kept.values())


def kept_gather_buffers(on_gpu: bool) -> GatherBuffers | None:
    """The raw export's gather buffers for a trainer rank: a `GatherBuffers` on a host without a GPU; None
    (each gather allocates, and its tensors are freed once the engine answered their chunk) on a GPU, whose
    caching allocator already reuses freed blocks, so kept buffers would only hold up to a stage's whole
    model in device memory between syncs (the sender holds at most a few chunks of it otherwise:
    `transport.sync.QUEUE_DEPTH`)."""
    return None if on_gpu else GatherBuffers()


# The tag of the export's point-to-point gathers on a host (`_exchange`): the sync's hand-off to the sender
# uses tag 0 on the default group, so a gather's message can never be taken by a hand-off's receive.
GATHER_TAG = 1


def _exchange(flat: torch.Tensor, parts: torch.Tensor, group: dist.ProcessGroup | None, to_first: bool) -> bool:
    """The communication of a gather on a host (gloo): `flat` is this rank's contribution, `parts` [size, n]
    the rows to fill (row r = group rank r's), this rank's own row excepted. Every rank sends `flat` straight
    from its memory and receives straight into `parts` (point to point, all at once). gloo's all-gather
    would receive into a flat tensor of its own and copy that out (`AsyncAllgatherWork` in torch's
    `ProcessGroupGloo.cpp`): a fresh allocation the size of the full tensor, its pages faulted by the
    receive, and one more pass over every byte, per parameter and sync (on a 2-core host, 0.8-0.95 s
    against 0.5 s for Qwen3-0.6B's TP 2 shards). `to_first`: only the group's first rank receives (the
    others send it their row and receive nothing). Returns whether this rank received."""
    me, size = dist.get_rank(group), parts.shape[0]
    receives = not to_first or me == 0
    ops = []
    for peer in range(size):
        if peer == me:
            continue
        if not to_first or peer == 0:
            ops.append(dist.P2POp(dist.isend, flat, group=group, tag=GATHER_TAG, group_peer=peer))
        if receives:
            ops.append(dist.P2POp(dist.irecv, parts[peer], group=group, tag=GATHER_TAG, group_peer=peer))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return receives


def _gather_stacked(
    t: torch.Tensor,
    group: dist.ProcessGroup | None,
    size: int,
    out: torch.Tensor | None = None,
    to_first: bool = False,
) -> torch.Tensor | None:
    """`t` from every rank of `group` into one buffer of shape [size, *t.shape] (entry r = group rank r's
    tensor), every byte written where it stays: no per-rank output tensors and no concatenation after it.
    `out`: a flat buffer of size * t.numel() elements of t's dtype to gather into (default: a new one).
    On a GPU one `all_gather_into_tensor` (NCCL writes in place); on a host the point-to-point exchange of
    `_exchange`. `to_first`: only the group's first rank needs the result; on a host the others only send,
    and get None (on a GPU every rank takes part in the all-gather and gets it)."""
    flat = t.contiguous().view(-1)
    if out is None:
        out = torch.empty(size * flat.numel(), dtype=t.dtype, device=t.device)
    if flat.is_cuda:
        dist.all_gather_into_tensor(out, flat, group=group)
        return out.view(size, *t.shape)
    parts = out.view(size, flat.numel())
    if not _exchange(flat, parts, group, to_first):
        return None
    parts[dist.get_rank(group)].copy_(flat)
    return out.view(size, *t.shape)


def tp_gather(
    param: torch.Tensor,
    tp_group: dist.ProcessGroup | None,
    tp_size: int,
    buffers: GatherBuffers | None = None,
    key: str = "",
    to_first: bool = False,
) -> torch.Tensor:
    """The full (unsharded) tensor of a TP-sharded parameter; replicated ones are returned as they are.

    Every TP rank of the group must call this for the same parameters in the same order (all-gather), or,
    with `to_first`, the group's first rank calls this and the others `tp_shards` (only the first one needs
    the full tensor: the stage leader).
    Shapes: shard [n/tp, ...] (partition_dim 0) -> full [n, ...]; stride s splits each shard into s
    blocks along partition_dim and concatenates block j of every rank before block j+1 (what
    `combine_shards` spells out). One gather into one buffer (`_gather_stacked`); partition_dim 0 with stride 1 (column-
    parallel weights, the vocab-parallel embedding) is that buffer as it is, other layouts take one
    strided copy of it. With `buffers`, the full tensor is a view of the buffer kept under (`key`, "tp"),
    which the next export that gathers `key` overwrites (`GatherBuffers`); without, new memory.

    Raises:
        RuntimeError: from `torch.distributed` when a rank of the group does not take part; with `to_first`
            on a host, when this rank is not its group's first.
    """
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return param.detach()
    shard = param.detach()
    dim, stride = int(param.partition_dim), int(getattr(param, "partition_stride", 1))
    numel, dtype = shard.numel() * tp_size, shard.dtype
    as_is = dim == 0 and stride == 1
    kept = buffers.kept((key, "tp"), numel, dtype) if buffers is not None else None
    stacked = _gather_stacked(shard, tp_group, tp_size, kept if as_is else _scratch(buffers, numel, dtype), to_first)
    if stacked is None:
        raise RuntimeError(
            f"tp_gather(to_first=True) of {key or 'a parameter'} on a rank that is not its TP group's first"
        )
    pre, post = shard.shape[:dim], shard.shape[dim + 1 :]
    full_shape = (*pre, shard.shape[dim] * tp_size, *post)
    if as_is:
        return stacked.view(full_shape)
    blocks = stacked.view(tp_size, *pre, stride, shard.shape[dim] // stride, *post)
    # [tp, *pre, stride, block, *post] -> [*pre, stride, tp, block, *post]: block j of every rank before j + 1
    order = [*range(1, dim + 2), 0, *range(dim + 2, blocks.dim())]
    moved = blocks.permute(order)
    if kept is None:
        return moved.contiguous().view(full_shape)
    return kept.view(moved.shape).copy_(moved).view(full_shape)


def _scratch(buffers: GatherBuffers | None, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
    return buffers.scratch(numel, dtype) if buffers is not None else None


def tp_shards(
    param: torch.Tensor, tp_group: dist.ProcessGroup | None, tp_size: int, buffers: GatherBuffers | None = None
) -> list[torch.Tensor]:
    """A TP rank's part in gathering a TP-sharded parameter for a rank that does not own it (a stage
    leader's TP peers, and the TP groups of other DP replicas): every shard, in rank order, on the group's
    first rank; on a host [] on the others, which only send theirs (on a GPU every rank takes part in the
    all-gather and gets every shard: `_gather_stacked`); [] for a replicated parameter or TP 1. The shards
    are views of one buffer: with `buffers`, its scratch buffer (valid until the next gather that uses it)."""
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return []
    shard = param.detach()
    out = _scratch(buffers, shard.numel() * tp_size, shard.dtype)
    stacked = _gather_stacked(shard, tp_group, tp_size, out, to_first=True)
    return [] if stacked is None else list(stacked.unbind(0))


def combine_shards(parts: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Full tensor from TP shards in rank order (see `tp_gather` for the stride rule)."""
    if stride == 1:
        return torch.cat(parts, dim=dim)
    blocks = [p.chunk(stride, dim=dim) for p in parts]
    return torch.cat([blocks[r][j] for j in range(stride) for r in range(len(parts))], dim=dim)


def ep_gather(
    full: torch.Tensor,
    ep_group: dist.ProcessGroup | None,
    ep_size: int,
    buffers: GatherBuffers | None = None,
    key: str = "",
) -> list[torch.Tensor]:
    """One local expert's tensor from every EP rank, in EP rank order (every EP rank must call this for
    the same local expert in the same order). Entry r is global expert r * num_local_experts + K; the
    entries are views of one buffer: with `buffers`, the one kept under (`key`, "ep") (`GatherBuffers`)."""
    if ep_size == 1:
        return [full]
    kept = buffers.kept((key, "ep"), full.numel() * ep_size, full.dtype) if buffers is not None else None
    return list(_gather_stacked(full, ep_group, ep_size, kept).unbind(0))
