"""The bridge export's per-stage task selection (which PP stage exports a parameter several stages hold), and
the bridge it exports through (built from the HF config: it reads no checkpoint tensor)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from reference_impl.export.bridge import lowest_stage
from reference_impl.models.registry import load_model


def test_a_name_held_by_several_stages_goes_to_the_lowest() -> None:
    per_stage = [
        ["embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc1.weight"],
        ["decoder.layers.1.mlp.linear_fc1.weight", "embedding.word_embeddings.weight", "output_layer.weight"],
    ]
    assert lowest_stage(per_stage) == {
        "embedding.word_embeddings.weight": 0,
        "decoder.layers.0.mlp.linear_fc1.weight": 0,
        "decoder.layers.1.mlp.linear_fc1.weight": 1,
        "output_layer.weight": 1,
    }


def test_a_stage_holding_nothing_owns_nothing() -> None:
    assert lowest_stage([[], ["a"], ["a", "b"]]) == {"a": 1, "b": 2}


# One rank (world size 1) builds Qwen3-VL-MoE from its seeded checkpoint and exports it twice: through the
# checkpoint's bridge (the library's `export_hf_weights` on `model.bridge`) and through the bridge mode
# (`export_bridge`), counting the library's checkpoint reads in each.
_TWO_EXPORTS = """
import json, sys
import torch
from reference_impl.trainer.cpu_shims import apply_cpu_shims
apply_cpu_shims()  # before Megatron-Bridge's first import (no Transformer Engine on a CPU host)
from megatron.bridge.models.hf_pretrained.state import SafeTensorsStateSource
from reference_impl.checksum import tensor_checksum
from reference_impl.engine.process import free_port
from reference_impl.export.bridge import export_bridge
from reference_impl.models.checkpoint import make_checkpoint
from reference_impl.models.registry import load_model
from reference_impl.trainer.model import build_model
from reference_impl.trainer.parallel import init_distributed, init_model_parallel

torch.set_num_threads(1)
spec = load_model("qwen3-vl-moe")
checkpoint = make_checkpoint(spec, seed=0, dtype="float32")
init_distributed(0, 1, "127.0.0.1", free_port())
layout = init_model_parallel(1, 1, 1)
model = build_model(checkpoint, spec.model_type, 1, 1, "float32")
reads = []
load = SafeTensorsStateSource.load_tensors
SafeTensorsStateSource.load_tensors = lambda self, keys: (reads.extend(keys), load(self, keys))[1]
exported = model.bridge.export_hf_weights(model.chunks, cpu=True, show_progress=False)
library = {n: tensor_checksum(t) for n, t in exported}
library_reads, reads[:] = list(reads), []
ours = {n: tensor_checksum(t) for n, t in export_bridge(model, layout)[0]}
print(json.dumps({"library": library, "library_reads": library_reads, "ours": ours, "our_reads": reads}))
"""


@pytest.mark.e2e
def test_the_bridge_mode_reads_no_checkpoint_tensor_and_exports_what_the_checkpoint_bridge_does() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _TWO_EXPORTS], capture_output=True, text=True, timeout=600, env=os.environ.copy()
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # the checkpoint's bridge reads both stacked expert tensors of every layer, once each, for their shapes
    layers = load_model("qwen3-vl-moe").config["text_config"]["num_hidden_layers"]
    stacked = {
        f"model.language_model.layers.{i}.mlp.experts.{w}" for i in range(layers) for w in ("gate_up_proj", "down_proj")
    }
    assert sorted(got["library_reads"]) == sorted(stacked)
    assert got["our_reads"] == []
    assert got["ours"] == got["library"]
