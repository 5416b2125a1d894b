"""Named fault injections: historical bug classes of weight-sync paths, for the harness's mutation tests.

Each fault is a small documented change applied inside the processes of ONE scenario only (never in
normal runs): trainer-side faults are functions the runner calls in every trainer rank's process
(`TrainerWorker.run_in_process`), which replace one function of the reference implementation; the
runner discards those processes after the scenario. Engine-side faults are passed to the embedded
engine server as `--fault NAME` (implemented there). Every fault names the scenario that shows it
and the verdict the harness must give (`scenarios/faults.yaml` lists them as scenarios with
`fault:` and `expect:`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch


@dataclass(frozen=True)
class Fault:
    """One fault: what bug it reproduces, where it is applied, and the verdict it must produce."""

    name: str
    description: str
    expect: str
    side: str  # "trainer" | "engine"
    scenario: dict[str, Any] = field(default_factory=dict)  # fields of the scenario that shows it
    apply: Callable[[], None] | None = None  # trainer side: patch the current process


# --- trainer-side patches (run inside each trainer rank's process) --------------------------------


def _pp_barrier_in_chunk_loop() -> None:
    """Stages hit a barrier once per chunk they take part in; the sender once per chunk of the whole
    plan. With PP = 2 the counts differ, and the ranks wait for each other forever."""
    import torch.distributed as dist

    from reference_impl.transport import sync

    orig_send, orig_collect = sync.send_owned, sync.collect_chunk

    def send_owned(plan, owned, rank):  # type: ignore[no-untyped-def]
        for chunk in plan:
            if any(m.owner == rank for m in chunk.tensors):
                orig_send([chunk], owned, rank)
                dist.barrier()

    def collect_chunk(chunk, owned):  # type: ignore[no-untyped-def]
        out = orig_collect(chunk, owned)
        dist.barrier()
        return out

    sync.send_owned, sync.collect_chunk = send_owned, collect_chunk


def _legacy_vision_names() -> None:
    """Vision parameters sent as `model.visual.` + the Megatron suffix (the name before the vision
    tower had its own conversion table): `model.visual.decoder.layers.0.self_attention.linear_proj.weight`."""
    from reference_impl.export import stream

    orig = stream.convert

    def convert(name, tensor, rules, facts):  # type: ignore[no-untyped-def]
        if name.startswith("vision_model."):
            return [("model.visual." + name.removeprefix("vision_model."), tensor)]
        return orig(name, tensor, rules, facts)

    stream.convert = convert


def _noncolocate_ignores_bridge() -> None:
    """The non-colocate path calls the raw exporter whatever mode was asked for."""
    from reference_impl.export import stream

    def export(mode, model, layout, facts):  # type: ignore[no-untyped-def]
        return stream.Export(*stream.export_raw(model, layout, facts), mode="raw")

    stream.export = export


def _gqa_split_wrong() -> None:
    """`linear_qkv` split as three contiguous blocks [q; k; v] (the HF layout, as if heads were
    hidden/heads wide and ungrouped) instead of per query group with head_dim: shapes are right, values
    are not."""
    from reference_impl.models.families import FAMILIES
    from reference_impl.models.raw_rules import FamilyTable, Rule, split_qkv

    def split_blocks(t: torch.Tensor, f):  # type: ignore[no-untyped-def]
        q_rows, kv_rows = f.num_heads * f.head_dim, f.num_kv_heads * f.head_dim
        return [t[:q_rows].contiguous(), t[q_rows : q_rows + kv_rows].contiguous(), t[q_rows + kv_rows :].contiguous()]

    for family, fam in list(FAMILIES.items()):
        rules = [Rule(r.megatron, r.hf, split_blocks) if r.transform is split_qkv else r for r in fam.raw.rules]
        FAMILIES[family] = replace(fam, raw=FamilyTable(rules, fam.raw.post))


def _ep_local_expert_ids() -> None:
    """Experts keep their local ids at EP = 2: each EP rank's expert K is sent as expert K, so the
    experts of EP rank 1 collide with rank 0's and experts E/2..E-1 are never updated."""
    from reference_impl.export import stream

    stream.ep_gather = lambda full, group, size: [full]


def _drop_last_chunk() -> None:
    """The sender's loop stops one chunk early (an off-by-one over the plan)."""
    from reference_impl.transport import sync

    sync.should_send = lambda chunk, plan: chunk.index < len(plan) - 1


def _tied_lm_head_sent() -> None:
    """A separate `lm_head.weight` (the embedding) is sent to an engine whose lm_head is tied."""
    from reference_impl.export import stream

    orig = stream.convert

    def convert(name, tensor, rules, facts):  # type: ignore[no-untyped-def]
        out = orig(name, tensor, rules, facts)
        if name.endswith("embedding.word_embeddings.weight"):
            out = [*out, ("lm_head.weight", out[0][1])]
        return out

    stream.convert = convert


def _wrong_dtype() -> None:
    """Chunks declared bfloat16 while their bytes are float32."""
    from reference_impl.transport import sync

    orig = sync.update_info

    def update_info(chunk):  # type: ignore[no-untyped-def]
        info = orig(chunk)
        info["dtype_names"] = ["bfloat16"] * len(info["dtype_names"])
        return info

    sync.update_info = update_info


def _ipc_buffer_reused_early() -> None:
    """The colocate producer reuses its buffer for the next chunk before the engine acknowledged the
    current one (here: overwritten with zeros between packing and the engine reading it)."""
    from reference_impl.transport import colocate
    from reference_impl.transport.wire import pack

    def send(self, client, tensors, info, sync):  # type: ignore[no-untyped-def]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.buffer.grow(nbytes)
        view = self.buffer.tensor(nbytes)
        pack(tensors, out=view)
        view.zero_()  # the next chunk's staging starts before this one was acknowledged
        return client.update({**info, "handle": self.buffer.handle(nbytes)}, sync, info["chunk_index"])

    colocate.SharedMemoryChannel.send = send


def _fused_drops_visual_kwargs() -> None:
    """The language model's forward no longer accepts `visual_pos_masks` / `deepstack_visual_embeds`
    (a refactor of the fused forward dropped the vision path's extra arguments)."""
    from transformers.models.qwen3_vl import modeling_qwen3_vl as m

    orig = m.Qwen3VLTextModel.forward

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,  # type: ignore[no-untyped-def]
        inputs_embeds=None,
        use_cache=None,
        cache_position=None,
    ):
        return orig(
            self,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            cache_position=cache_position,
        )

    m.Qwen3VLTextModel.forward = forward


def _temperature_not_passed() -> None:
    """The trainer's fused log-prob path never receives the sampling temperature (it computes at T = 1)."""
    from reference_impl.forward import logprobs

    orig = logprobs.fused_logprobs
    logprobs.fused_logprobs = lambda hidden, weight, targets, temperature=1.0, **kw: orig(hidden, weight, targets, **kw)


def _position_ids_wrong_shape() -> None:
    """The caller passes text-style [batch, seq] position ids to the mRoPE model."""
    from reference_impl.forward import reference

    orig = reference.vl_hidden_states

    def vl_hidden_states(model, input_ids, pixel_values, image_grid_thw, position_ids=None):  # type: ignore[no-untyped-def]
        flat = torch.arange(input_ids.shape[1])[None].expand_as(input_ids)
        return orig(model, input_ids, pixel_values, image_grid_thw, flat)

    reference.vl_hidden_states = vl_hidden_states


_SMALL = {"syncs": 2, "bucket_bytes": 65536}

FAULTS: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            "pp_barrier_in_chunk_loop",
            "a barrier inside the per-chunk loop while PP stages have different chunk counts",
            "DEADLOCK",
            "trainer",
            {"model": "qwen3", "pp": 2, "deadline_s": 30, **_SMALL},
            _pp_barrier_in_chunk_loop,
        ),
        Fault(
            "legacy_vision_names",
            "vision parameters sent as model.visual. + the Megatron suffix",
            "NAME_ERROR",
            "trainer",
            {"model": "qwen3-vl", **_SMALL},
            _legacy_vision_names,
        ),
        Fault(
            "noncolocate_ignores_bridge",
            "bridge requested, the raw path used in non-colocate mode",
            "PARITY_FAIL",
            "trainer",
            {"model": "qwen3", "mode": "bridge", **_SMALL},
            _noncolocate_ignores_bridge,
        ),
        Fault(
            "gqa_split_wrong",
            "q/k/v split as contiguous blocks instead of head_dim query groups",
            "PARITY_FAIL",
            "trainer",
            {"model": "qwen3", **_SMALL},
            _gqa_split_wrong,
        ),
        Fault(
            "ep_local_expert_ids",
            "local expert ids sent as global at EP = 2",
            "COVERAGE_GAP",
            "trainer",
            {"model": "qwen3-moe", "ep": 2, **_SMALL},
            _ep_local_expert_ids,
        ),
        Fault(
            "drop_last_chunk",
            "the last chunk is never sent",
            "CHUNK_MISMATCH",
            "trainer",
            {"model": "qwen3", **_SMALL},
            _drop_last_chunk,
        ),
        Fault(
            "finalize_per_chunk",
            "the engine restores parameters not in the current chunk on each update",
            "PARITY_FAIL",
            "engine",
            {"model": "qwen3", **_SMALL},
        ),
        Fault(
            "tied_lm_head_sent",
            "a separate lm_head sent to an engine with tied embeddings",
            "NAME_ERROR",
            "trainer",
            {"model": "qwen3", **_SMALL},
            _tied_lm_head_sent,
        ),
        Fault(
            "ok_without_transfer",
            "the engine answers 200 to /update_weights without loading what it received",
            "PARITY_FAIL",
            "engine",
            {"model": "qwen3", **_SMALL},
        ),
        Fault(
            "wrong_dtype",
            "chunks declared bfloat16 but sent as float32",
            "HTTP_ERROR",
            "trainer",
            {"model": "qwen3", **_SMALL},
            _wrong_dtype,
        ),
        Fault(
            "ipc_buffer_reused_early",
            "the colocate producer overwrites its buffer before the engine acknowledged the chunk",
            "PARITY_FAIL",
            "trainer",
            {"model": "qwen3", "colocate": True, **_SMALL},
            _ipc_buffer_reused_early,
        ),
        Fault(
            "fused_drops_visual_kwargs",
            "the fused log-prob forward no longer passes visual_pos_masks to the language model",
            "CRASH",
            "trainer",
            {"model": "qwen3-vl", **_SMALL},
            _fused_drops_visual_kwargs,
        ),
        Fault(
            "temperature_not_passed",
            "the sampling temperature never reaches the trainer's fused log-prob path",
            "PARITY_FAIL",
            "trainer",
            {"model": "qwen3-vl", **_SMALL},
            _temperature_not_passed,
        ),
        Fault(
            "position_ids_wrong_shape",
            "[batch, seq] position ids handed to an mRoPE model (needs (3 or 4, batch, seq))",
            "CRASH",
            "trainer",
            {"model": "qwen3-vl", **_SMALL},
            _position_ids_wrong_shape,
        ),
    ]
}


def fault_scenarios() -> list[dict[str, Any]]:
    """One scenario entry per fault (what `scenarios/faults.yaml` holds), with `fault` and `expect`."""
    return [{**f.scenario, "fault": f.name, "expect": f.expect, "suffix": f"fault-{f.name}"} for f in FAULTS.values()]
