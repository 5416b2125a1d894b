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


def iter_global_params(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(global Megatron name, local parameter) for every parameter of this rank's model chunks.

    Wrappers (`Float16Module` in bf16/fp16, DDP) are looked through: names never carry `module.`.
    """
    for chunk in chunks:
        while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
            chunk = chunk.module
        offsets = layer_offsets(chunk)
        for name, p in chunk.named_parameters():
            yield global_name(name, offsets), p


def tp_gather(param: torch.Tensor, tp_group: dist.ProcessGroup | None, tp_size: int) -> torch.Tensor:
    """The full (unsharded) tensor of a TP-sharded parameter; replicated ones are returned as they are.

    Every TP rank of the group must call this for the same parameters in the same order (all-gather).
    Shapes: shard [n/tp, ...] (partition_dim 0) -> full [n, ...]; stride s splits each shard into s
    blocks along partition_dim and concatenates block j of every rank before block j+1.
    """
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return param.detach()
    dim = int(param.partition_dim)
    stride = int(getattr(param, "partition_stride", 1))
    shard = param.detach().contiguous()
    parts = [torch.empty_like(shard) for _ in range(tp_size)]
    dist.all_gather(parts, shard, group=tp_group)
    return combine_shards(parts, dim, stride)


def combine_shards(parts: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Full tensor from TP shards in rank order (see `tp_gather` for the stride rule)."""
    if stride == 1:
        return torch.cat(parts, dim=dim)
    blocks = [p.chunk(stride, dim=dim) for p in parts]
    return torch.cat([blocks[r][j] for j in range(stride) for r in range(len(parts))], dim=dim)
