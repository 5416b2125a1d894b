"""How vLLM splits each parameter over its tensor-parallel workers, per model family, and each rank's piece.

vLLM's TP workers each hold a shard of every parallel layer (`vllm/model_executor/layers/linear.py`,
`vocab_parallel_embedding.py`), and each worker's weight loader cuts its piece out of the full
checkpoint tensor it is handed. The partition of a vLLM parameter follows from its layer class:

- `qkv`, `QKVParallelLinear` (`qkv_proj`): rank r holds output rows [q of its heads; k of its KV heads;
  v of its KV heads]: `nh/t` query heads (from head `r*nh/t`) and `max(1, nkv/t)` KV heads of KV shard
  `r // replicas`, `replicas = max(1, t/nkv)` (a KV head is replicated over `t/nkv` ranks when TP exceeds
  the KV heads); `weight_loader`: `shard_rank = tp_rank // num_kv_head_replicas`,
  `start_idx = shard_rank * shard_size`.
- `merged_column`, `MergedColumnParallelLinear` (`gate_up_proj`): output rows [its 1/t of gate; its 1/t
  of up] (`shard_offset = sum(output_sizes[:id]) // t`, `start_idx = tp_rank * shard_size`).
- `row`, `RowParallelLinear` (`o_proj`, `down_proj`): input columns `r*in/t .. (r+1)*in/t`.
- `vocab`, `VocabParallelEmbedding` / `ParallelLMHead` (`embed_tokens`, `lm_head`): rows
  `r*p/t .. (r+1)*p/t` of the vocabulary padded to `p`, a multiple of 64 (`DEFAULT_VOCAB_PADDING_SIZE`,
  `pad_vocab_size`); rows past the real vocabulary are zero (`weight_loader`: `param[loaded:].fill_(0)`).
- `replicated`: everything else (RMSNorm weights, `q_norm`, `k_norm`): the whole tensor on every rank.

Rank r's piece of one checkpoint tensor is a `Piece`: the rows (or columns) `src_start .. src_start + size`
along `dim` of the checkpoint tensor, at `dst_offset` along `dim` of the rank's shard of the vLLM
parameter, whose shape is `shard_shape`. `TP_RULES` holds the families whose vLLM TP layout this file
knows (the dense Qwen3 text model, `vllm/model_executor/models/qwen3.py`); `pieces` is the one function
that applies them (a seam: `reference_impl.seams`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

PartitionKind = Literal["qkv", "merged_column", "row", "vocab", "replicated"]
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE (vocab_parallel_embedding.py)

# model_type -> (regex of a vLLM parameter name, its partition kind); first match wins, else replicated.
TP_RULES: dict[str, tuple[tuple[str, PartitionKind], ...]] = {
    "qwen3": (
        (r".*\.self_attn\.qkv_proj\.weight", "qkv"),
        (r".*\.mlp\.gate_up_proj\.weight", "merged_column"),
        (r".*\.self_attn\.o_proj\.weight", "row"),
        (r".*\.mlp\.down_proj\.weight", "row"),
        (r"model\.embed_tokens\.weight", "vocab"),
        (r"lm_head\.weight", "vocab"),
    ),
}


@dataclass(frozen=True)
class TpDims:
    """The numbers a partition needs: query heads, KV heads, head_dim, the MLP's intermediate size, the
    vocabulary, all of the text model's config (`config.json`)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: dict[str, object]) -> TpDims:
        """From a Qwen3 `config.json` dict (`head_dim` defaults to hidden_size / num_attention_heads)."""
        heads = int(config["num_attention_heads"])  # type: ignore[arg-type]
        head_dim = config.get("head_dim") or int(config["hidden_size"]) // heads  # type: ignore[arg-type]
        return cls(
            num_heads=heads,
            num_kv_heads=int(config["num_key_value_heads"]),  # type: ignore[arg-type]
            head_dim=int(head_dim),  # type: ignore[arg-type]
            intermediate_size=int(config["intermediate_size"]),  # type: ignore[arg-type]
            vocab_size=int(config["vocab_size"]),  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class Piece:
    """Rank r's piece of one checkpoint tensor (see the module doc); offsets and sizes in elements along
    `dim`; `shard_shape` is the shape of the rank's shard of the whole vLLM parameter."""

    dim: int
    src_start: int
    size: int
    dst_offset: int
    shard_shape: tuple[int, ...]


def has_tp_rules(model_type: str) -> bool:
    """Whether this file knows vLLM's TP layout of `model_type` (`TP_RULES`)."""
    return model_type in TP_RULES


def partition_of(model_type: str, vllm_name: str) -> PartitionKind:
    """The partition kind of vLLM parameter `vllm_name` of `model_type`.

    Raises:
        KeyError: a model_type without TP rules.
    """
    for pattern, kind in TP_RULES[model_type]:
        if re.fullmatch(pattern, vllm_name):
            return kind
    return "replicated"


def padded_vocab(vocab_size: int) -> int:
    """The vocabulary rounded up to a multiple of `VOCAB_PADDING` (vLLM `pad_vocab_size`)."""
    return math.ceil(vocab_size / VOCAB_PADDING) * VOCAB_PADDING


def pieces(
    kind: PartitionKind, shard: str | int | None, shape: tuple[int, ...], rank: int, tp: int, dims: TpDims
) -> Piece:
    """Rank `rank`'s piece (of `tp` ranks) of one checkpoint tensor of shape `shape` that loads into a vLLM
    parameter of partition `kind` at shard id `shard` ("q" | "k" | "v" for qkv, 0 | 1 for gate/up, None
    otherwise). A seam (`reference_impl.seams`).

    Raises:
        ValueError: `tp` does not divide what the partition splits, or an unknown shard id.
    """
    if kind == "replicated":
        return Piece(0, 0, shape[0], 0, tuple(shape))
    if kind == "row":
        cols = _divide(shape[1], tp, "input columns")
        return Piece(1, rank * cols, cols, 0, (shape[0], cols))
    if kind == "vocab":
        per = _divide(padded_vocab(dims.vocab_size), tp, "padded vocabulary")
        start = min(rank * per, shape[0])
        end = min(start + per, shape[0])
        return Piece(0, start, end - start, 0, (per, *shape[1:]))
    if kind == "merged_column":
        per = _divide(dims.intermediate_size, tp, "intermediate size")
        if shard not in (0, 1):
            raise ValueError(f"gate_up_proj shard {shard!r}: expected 0 (gate) or 1 (up)")
        return Piece(0, rank * per, per, int(shard) * per, (2 * per, *shape[1:]))
    if kind == "qkv":
        heads = _divide(dims.num_heads, tp, "query heads")
        replicas = max(1, tp // dims.num_kv_heads)
        kv_heads = max(1, _divide(dims.num_kv_heads, tp, "KV heads") if tp <= dims.num_kv_heads else 1)
        rows = (heads + 2 * kv_heads) * dims.head_dim
        if shard == "q":
            size = heads * dims.head_dim
            return Piece(0, rank * size, size, 0, (rows, *shape[1:]))
        if shard in ("k", "v"):
            size = kv_heads * dims.head_dim
            offset = heads * dims.head_dim + (size if shard == "v" else 0)
            return Piece(0, (rank // replicas) * size, size, offset, (rows, *shape[1:]))
        raise ValueError(f"qkv_proj shard {shard!r}: expected 'q', 'k' or 'v'")
    raise ValueError(f"unknown partition kind {kind!r}")


def _divide(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"TP {tp} does not divide the {what} ({n})")
    return n // tp
