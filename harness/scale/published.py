"""Published weight-update figures and what the model predicts for each, on the same hardware.

Each `Figure` names its public source. A model not shipped under `scenarios/models/` is described by the
architecture numbers of its published config.json (`ARCHITECTURES`, with the URL), which is all the hand
formula of `params.py` reads.

checkpoint-engine's broadcast update is a different design from ours; `checkpoint_engine_s` models it
with the same links: every GPU uploads its 1/N of the checkpoint from host memory over PCIe, the
buckets are broadcast to all N GPUs over NVLink (each GPU receives every byte), and each engine TP rank
copies its shard and walks every tensor name (README of MoonshotAI/checkpoint-engine, "Architecture":
H2D, broadcast, reload).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.scale.params import param_count
from harness.scale.update_time import GB, Links, Topology, Workload, predict

ARCHITECTURES: dict[str, dict[str, Any]] = {
    # https://huggingface.co/Qwen/Qwen3-235B-A22B-Instruct-2507/blob/main/config.json (Qwen3MoeForCausalLM)
    "qwen3-235b-a22b": {
        "hidden_size": 4096,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_hidden_layers": 94,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_experts": 128,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
}


@dataclass(frozen=True)
class Figure:
    """One published update time: model, hardware, layout, seconds, and where it was published."""

    name: str
    model: str  # a key of ARCHITECTURES or a shipped config file name under scenarios/models/
    links: str  # a preset of `presets.PRESETS`
    seconds: float
    source: str
    note: str = ""


FIGURES: tuple[Figure, ...] = (
    Figure(
        name="checkpoint-engine broadcast, Qwen3-235B-A22B-Instruct-2507 BF16, 8xH800 TP8",
        model="qwen3-235b-a22b",
        links="h800",
        seconds=6.22,
        source="https://github.com/MoonshotAI/checkpoint-engine (README, Benchmark: Update (Broadcast))",
        note="bucket 2.67 GiB; an earlier README revision gave 6.75 s",
    ),
    Figure(
        name="Qwen3-4B, 1 trainer GPU + 1 engine GPU, raw export",
        model="qwen3-4b.config.json",
        links="h100",
        seconds=0.3,
        source="quoted figure, primary source not located",
    ),
    Figure(
        name="Qwen3-4B, 1 trainer GPU + 1 engine GPU, bridge export",
        model="qwen3-4b.config.json",
        links="h100",
        seconds=0.5,
        source="quoted figure, primary source not located",
    ),
)


def checkpoint_engine_s(w: Workload, gpus: int, links: Links) -> dict[str, float]:
    """Seconds per stage of checkpoint-engine's broadcast update over `gpus` GPUs of one node (module
    doc): `h2d` (1/N of the bytes per GPU over PCIe, in parallel), `broadcast` (every byte to every GPU
    over NVLink, pipelined), `reload` (a shard per GPU through one device copy, and every tensor's
    fixed cost), `total`."""
    h2d = w.bytes / gpus / (links.pcie * GB)
    broadcast = w.bytes / (links.nvlink * GB)
    reload = w.bytes / gpus / (links.hbm_copy * GB) + w.tensors * links.tensor_s
    return {"h2d": h2d, "broadcast": broadcast, "reload": reload, "total": h2d + broadcast + reload}


def ours_s(w: Workload, topo: Topology, links: Links) -> float:
    """The harness's design on the same hardware (`update_time.predict`)."""
    return predict(w, topo, links).total


def workload(config: dict[str, Any], dtype: str = "bfloat16", chunk_bytes: int = 1 << 30) -> Workload:
    """The sync of a model described by `config`, in `dtype`, in chunks of `chunk_bytes`."""
    c = param_count(config)
    size = c.bytes(dtype) // c.total
    return Workload(
        bytes=c.bytes(dtype),
        tensors=c.tensors,
        chunk_bytes=chunk_bytes,
        expert_bytes=c.experts * size,
        stacked_experts=c.stacked_experts,
    )
