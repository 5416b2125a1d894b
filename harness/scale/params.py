"""Parameter counts and bytes per sync of a Qwen3-family model, by hand formula from its HF config.json.

The formula is written from the transformers 5.12.1 module definitions, not from any code of the system
under test, so it can check what a sync moves (`bytes_per_sync` of the run tables) and be checked
against a checkpoint's actual bytes (`tests/test_scale_model.py`):

- text model (`modeling_qwen3.py`, `modeling_qwen3_moe.py`, `modeling_qwen3_vl*.py`): token embedding
  [V, H]; per layer q/k/v/o projections [nH*hd, H], [nKV*hd, H] x2, [H, nH*hd] (biases of size
  nH*hd, nKV*hd x2, H when `attention_bias`), q_norm and k_norm [hd], input and post-attention RMSNorm
  [H]; a dense MLP gate/up/down [I, H] x2 + [H, I], or, on a sparse layer (`layer not in
  mlp_only_layers` and `(layer + 1) % decoder_sparse_step == 0`), a router [E, H] and E experts of
  gate/up/down [I_moe, H] x2 + [H, I_moe] (Qwen3-VL-MoE stores them fused, same count); final norm
  [H]; `lm_head` [V, H] unless `tie_word_embeddings`.
- vision tower (`Qwen3VLVisionModel`): patch Conv3d [h, C, tps, p, p] + bias [h]; position embedding
  [P, h]; per block two LayerNorms (weight + bias) [h], qkv [3h, h] + [3h], proj [h, h] + [h], MLP
  [i, h] + [i], [h, i] + [h]; a merger with LayerNorm over h and two Linears (m = h * merge^2)
  [m, m] + [m], [out, m] + [out]; one deepstack merger per deepstack index, as the merger but with its
  LayerNorm over m.

Counts are elements; `bytes` multiplies by the element size of the dtype (2 for bfloat16, 4 for
float32). `tensors` counts the HF tensors a sync sends (a checkpoint's keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ParamCount:
    """Elements per part of a model and the number of HF tensors. `experts` are the routed experts'
    weights only (the part EP shards); `dense` is everything else of the text model."""

    embedding: int
    lm_head: int
    attention: int  # projections, their biases and the q/k norms
    norms: int  # layer norms and the final norm
    mlp: int  # dense MLPs
    router: int
    experts: int
    vision: int
    tensors: int
    stacked_experts: bool = False  # one HF tensor per layer and projection holds every expert (Qwen3-VL-MoE)

    @property
    def total(self) -> int:
        """All elements (tied embeddings counted once)."""
        text = self.embedding + self.lm_head + self.attention + self.norms + self.mlp + self.router
        return text + self.experts + self.vision

    @property
    def dense(self) -> int:
        """Every element but the routed experts'."""
        return self.total - self.experts

    def bytes(self, dtype: str) -> int:
        """Bytes of all elements in `dtype` (a key of `DTYPE_BYTES`).

        Raises:
            KeyError: an unknown dtype name.
        """
        return self.total * DTYPE_BYTES[dtype]


def _num_experts(text: dict[str, Any]) -> int:
    """Routed experts: `num_experts` in the released configs, `num_local_experts` in the ones
    transformers 5 writes."""
    return int(text.get("num_experts") or text.get("num_local_experts") or 0)


def _is_sparse(layer: int, text: dict[str, Any]) -> bool:
    experts = _num_experts(text)
    step = text.get("decoder_sparse_step", 1) or 1
    return experts > 0 and layer not in (text.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def _text(text: dict[str, Any], tied: bool, fused_experts: bool) -> dict[str, int]:
    h, v = text["hidden_size"], text["vocab_size"]
    nh, nkv = text["num_attention_heads"], text["num_key_value_heads"]
    hd = text.get("head_dim") or h // nh
    bias = bool(text.get("attention_bias", False))
    per_attn = h * nh * hd + 2 * h * nkv * hd + nh * hd * h + 2 * hd
    per_attn += (nh * hd + 2 * nkv * hd + h) if bias else 0
    attn_tensors = 6 + (4 if bias else 0)  # q/k/v/o + q_norm, k_norm (+ four biases)
    out = {"embedding": v * h, "lm_head": 0 if tied else v * h, "attention": 0, "norms": h, "mlp": 0}
    out |= {"router": 0, "experts": 0, "tensors": 2 + (0 if tied else 1)}  # embed, final norm, lm_head
    e, moe_i = _num_experts(text), text.get("moe_intermediate_size", 0) or 0
    for layer in range(text["num_hidden_layers"]):
        out["attention"] += per_attn
        out["norms"] += 2 * h
        out["tensors"] += attn_tensors + 2
        if _is_sparse(layer, text):
            out["router"] += e * h
            out["experts"] += e * 3 * h * moe_i
            out["tensors"] += 1 + (2 if fused_experts else 3 * e)
        else:
            out["mlp"] += 3 * h * text["intermediate_size"]
            out["tensors"] += 3
    return out


def _merger(h: int, merge: int, out_hidden: int, postshuffle: bool) -> int:
    m = h * merge * merge
    return 2 * (m if postshuffle else h) + m * m + m + out_hidden * m + out_hidden


def _vision(vision: dict[str, Any]) -> tuple[int, int]:
    """(elements, tensors) of a Qwen3-VL vision tower."""
    h, i, depth = vision["hidden_size"], vision["intermediate_size"], vision["depth"]
    p, tps, c = vision["patch_size"], vision["temporal_patch_size"], vision.get("in_channels", 3)
    merge, out_hidden = vision["spatial_merge_size"], vision["out_hidden_size"]
    deepstack = len(vision.get("deepstack_visual_indexes") or [])
    n = h * c * tps * p * p + h + vision["num_position_embeddings"] * h
    n += depth * (4 * h + 3 * h * h + 3 * h + h * h + h + i * h + i + h * i + h)
    n += _merger(h, merge, out_hidden, postshuffle=False) + deepstack * _merger(h, merge, out_hidden, postshuffle=True)
    tensors = 3 + depth * 12 + (1 + deepstack) * 6
    return n, tensors


def param_count(config: dict[str, Any]) -> ParamCount:
    """Elements and HF tensors of the model an HF `config` (a config.json dict) describes.

    A config with `text_config` is a Qwen3-VL model (vision tower from `vision_config`, fused experts
    when the text model has experts); otherwise a Qwen3 / Qwen3-MoE text model with per-expert tensors.

    Raises:
        KeyError: the config lacks a field the formula needs (e.g. `hidden_size`).
    """
    vl = "text_config" in config
    text = config["text_config"] if vl else config
    tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    parts = _text(text, tied, fused_experts=vl)
    vision, vision_tensors = _vision(config["vision_config"]) if vl else (0, 0)
    return ParamCount(
        embedding=parts["embedding"],
        lm_head=parts["lm_head"],
        attention=parts["attention"],
        norms=parts["norms"],
        mlp=parts["mlp"],
        router=parts["router"],
        experts=parts["experts"],
        vision=vision,
        tensors=parts["tensors"] + vision_tensors,
        stacked_experts=vl and parts["experts"] > 0,
    )
