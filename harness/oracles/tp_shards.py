"""What each TP rank of a vLLM-layout engine must hold: vLLM's partition of the expected state, per rank.

Written from vLLM's layer classes (`vllm/model_executor/layers/linear.py`, `vocab_parallel_embedding.py`;
the Qwen3 model in `vllm/model_executor/models/qwen3.py` stacks q/k/v into `qkv_proj` and gate/up into
`gate_up_proj`), for the dense Qwen3 text model, and in its own terms: the query and KV heads as lists of
head indices, the MLP and the vocabulary as equal row or column blocks (`torch.chunk`). It imports nothing
of the engine (not its TP ranks, not the partition table of `reference_impl.models.vllm_tp`), so a rank
that keeps the wrong piece cannot agree with it by sharing the mistake.

Rank r of TP t, with nh query heads, nkv KV heads of head_dim d, intermediate size I and vocabulary V:

- `qkv_proj.weight` = [q heads r*nh/t ... (r+1)*nh/t - 1; its KV heads of k; the same of v] (rows of d
  each); its KV heads are r*nkv/t ... when t <= nkv, else the single head r // (t/nkv) (replicated);
- `gate_up_proj.weight` = [block r of t of gate's rows; block r of t of up's rows];
- `o_proj.weight`, `down_proj.weight`: block r of t of the columns;
- `embed_tokens.weight` / untied `lm_head.weight`: block r of t of the rows of the vocabulary padded with
  zero rows to a multiple of 64;
- every other tensor whole.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from harness.oracles.digest import tensor_digest

PADDING = 64


def _heads(w: torch.Tensor, heads: list[int], head_dim: int) -> torch.Tensor:
    """Rows of the listed heads (each `head_dim` rows) of a [heads*head_dim, hidden] projection."""
    return torch.cat([w[h * head_dim : (h + 1) * head_dim] for h in heads])


def rank_shards(
    tensors: Mapping[str, torch.Tensor], config: Mapping[str, object], tp: int, rank: int
) -> dict[str, torch.Tensor]:
    """vLLM parameter name -> rank `rank`'s shard, from the full HF tensors `tensors` of a Qwen3 checkpoint
    (`config`: its config.json). Raises KeyError on a checkpoint that lacks a q/k/v or gate/up partner."""
    nh = int(config["num_attention_heads"])  # type: ignore[arg-type]
    nkv = int(config["num_key_value_heads"])  # type: ignore[arg-type]
    d = int(config.get("head_dim") or int(config["hidden_size"]) // nh)  # type: ignore[arg-type]
    q_heads = list(range(rank * nh // tp, (rank + 1) * nh // tp))
    kv_heads = list(range(rank * nkv // tp, (rank + 1) * nkv // tp)) if tp <= nkv else [rank // (tp // nkv)]
    out: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if name.endswith(".self_attn.q_proj.weight"):
            base = name.removesuffix("q_proj.weight")
            k, v = tensors[base + "k_proj.weight"], tensors[base + "v_proj.weight"]
            out[base + "qkv_proj.weight"] = torch.cat(
                [_heads(w, q_heads, d), _heads(k, kv_heads, d), _heads(v, kv_heads, d)]
            )
        elif name.endswith((".self_attn.k_proj.weight", ".self_attn.v_proj.weight", ".mlp.up_proj.weight")):
            continue  # stacked with their partner above / below
        elif name.endswith(".mlp.gate_proj.weight"):
            base = name.removesuffix("gate_proj.weight")
            up = tensors[base + "up_proj.weight"]
            out[base + "gate_up_proj.weight"] = torch.cat([w.chunk(tp)[rank], up.chunk(tp)[rank]])
        elif name.endswith((".self_attn.o_proj.weight", ".mlp.down_proj.weight")):
            out[name] = w.chunk(tp, dim=1)[rank]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            padded = torch.zeros((-(-w.shape[0] // PADDING) * PADDING, *w.shape[1:]), dtype=w.dtype)
            padded[: w.shape[0]] = w
            out[name] = padded.chunk(tp)[rank]
        else:
            out[name] = w
    return out


def expected_tp_checksums(
    tensors: Mapping[str, torch.Tensor], config: Mapping[str, object], tp: int
) -> dict[str, dict[str, str]]:
    """TP rank (as a string) -> vLLM parameter name -> `tensor_digest` of the shard that rank must hold."""
    return {str(r): {n: tensor_digest(t) for n, t in rank_shards(tensors, config, tp, r).items()} for r in range(tp)}
