"""Named fault injections: historical bug classes of weight-sync paths, for the harness's mutation tests.

Faults are test equipment and live only here. Each is a small documented change applied inside the
processes of ONE scenario only (never in normal runs), always through the named seams of the system
under test (`reference_impl.seams`):

- trainer side (`faults.trainer`): a function the runner calls in every trainer rank's process
  (`TrainerWorker.run_in_process`); the runner discards those processes after the scenario;
- engine side (`faults.engine`): a hook `MODULE:FUNCTION` the engine process loads at start
  (`--fault`), for engines whose adapter declares `fault_hooks`.

Every fault names the scenario that shows it and the verdict the harness must give;
`fault_scenarios()` turns the registry into scenarios with `fault:` and `expect:`, and
`python -m harness faults` runs them all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harness.faults import engine, trainer


@dataclass(frozen=True)
class Fault:
    """One fault: what bug it reproduces, where it is applied, and the verdict it must produce.

    `apply` is the function that injects it (in `faults.trainer` for side "trainer", `faults.engine`
    for side "engine").
    """

    name: str
    description: str
    expect: str
    side: str  # "trainer" | "engine"
    scenario: dict[str, Any] = field(default_factory=dict)  # fields of the scenario that shows it
    apply: Callable[[], None] | None = None

    @property
    def hook(self) -> str:
        """The `--fault MODULE:FUNCTION` an engine loads at start for an engine-side fault."""
        assert self.apply is not None
        return f"{self.apply.__module__}:{self.apply.__name__}"


_SMALL = {"syncs": 2, "chunk_bytes": 65536}
# Long enough for the resource check to fit a slope after its warm-up half (`checks.resources`).
_SOAK = {"syncs": 12, "chunk_bytes": 65536}

FAULTS: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            "pp_barrier_in_chunk_loop",
            "a barrier inside the per-chunk loop while PP stages have different chunk counts",
            "DEADLOCK",
            "trainer",
            {"model": "qwen3", "pp": 2, "deadline_s": 30, **_SMALL},
            trainer.pp_barrier_in_chunk_loop,
        ),
        Fault(
            "legacy_vision_names",
            "vision parameters sent as model.visual. + the Megatron suffix",
            "NAME_ERROR",
            "trainer",
            {"model": "qwen3-vl", **_SMALL},
            trainer.legacy_vision_names,
        ),
        Fault(
            "noncolocate_ignores_bridge",
            "bridge requested, the raw path used in non-colocate mode",
            "PARITY_FAIL",
            "trainer",
            {"model": "qwen3", "export_mode": "bridge", **_SMALL},
            trainer.noncolocate_ignores_bridge,
        ),
        Fault(
            "gqa_split_wrong",
            "q/k/v split as contiguous blocks instead of head_dim query groups",
            "PARITY_FAIL",
            "trainer",
            {"model": "qwen3", **_SMALL},
            trainer.gqa_split_wrong,
        ),
        Fault(
            "ep_local_expert_ids",
            "local expert ids sent as global at EP = 2",
            "COVERAGE_GAP",
            "trainer",
            {"model": "qwen3-moe", "ep": 2, **_SMALL},
            trainer.ep_local_expert_ids,
        ),
        Fault(
            "drop_last_chunk",
            "the last chunk is never sent",
            "CHUNK_MISMATCH",
            "trainer",
            {"model": "qwen3", **_SMALL},
            trainer.drop_last_chunk,
        ),
        Fault(
            "finalize_per_chunk",
            "the engine restores parameters not in the current chunk on each update",
            "PARITY_FAIL",
            "engine",
            {"model": "qwen3", **_SMALL},
            engine.finalize_per_chunk,
        ),
        Fault(
            "tied_lm_head_sent",
            "a separate lm_head sent to an engine with tied embeddings",
            "NAME_ERROR",
            "trainer",
            {"model": "qwen3", **_SMALL},
            trainer.tied_lm_head_sent,
        ),
        Fault(
            "ok_without_transfer",
            "the engine answers 200 to /update_weights without loading what it received",
            "PARITY_FAIL",
            "engine",
            {"model": "qwen3", **_SMALL},
            engine.ok_without_transfer,
        ),
        Fault(
            "wrong_dtype",
            "chunks declared bfloat16 but sent as float32",
            "HTTP_ERROR",
            "trainer",
            {"model": "qwen3", **_SMALL},
            trainer.wrong_dtype,
        ),
        Fault(
            "ipc_buffer_reused_early",
            "the colocate producer overwrites its buffer before the engine acknowledged the chunk",
            "PARITY_FAIL",
            "trainer",
            {"model": "qwen3", "colocate": True, **_SMALL},
            trainer.ipc_buffer_reused_early,
        ),
        Fault(
            "fused_drops_visual_kwargs",
            "the fused log-prob forward no longer passes visual_pos_masks / deepstack embeddings to the language "
            "model",
            "PARITY_FAIL",
            "trainer",
            {"model": "qwen3-vl", **_SMALL},
            trainer.fused_drops_visual_kwargs,
        ),
        Fault(
            "temperature_not_passed",
            "the sampling temperature never reaches the trainer's fused log-prob path",
            "PARITY_FAIL",
            "trainer",
            {"model": "qwen3-vl", **_SMALL},
            trainer.temperature_not_passed,
        ),
        Fault(
            "position_ids_wrong_shape",
            "[batch, seq] position ids handed to the trainer-side mRoPE forward, which raises: its oracle "
            "could not run, the verdict comes from the other checks",
            "PASS",
            "trainer",
            {"model": "qwen3-vl", **_SMALL, "expect_note": "oracle could not run"},
            trainer.position_ids_wrong_shape,
        ),
        Fault(
            "stale_cache_in_sync_loop",
            "the sync loop re-sends the tensors it cached at sync 0 at every later sync",
            "PARITY_FAIL",
            "trainer",
            {"model": "qwen3", "pp": 2, "export_mode": "bridge", "syncs": 3, "chunk_bytes": 65536},
            trainer.stale_cache_in_sync_loop,
        ),
        Fault(
            "step_skips_one_parameter",
            "the trainer's step never reaches one parameter (the final norm)",
            "PARITY_FAIL",
            "trainer",
            {"model": "qwen3", "syncs": 3, "chunk_bytes": 65536},
            trainer.step_skips_one_parameter,
        ),
        Fault(
            "transposed_fused_experts",
            "Qwen3-VL-MoE's fused expert tensors sent with their last two dims swapped",
            "HTTP_ERROR",
            "trainer",
            {"model": "qwen3-vl-moe", "ep": 2, **_SMALL},
            trainer.transposed_fused_experts,
        ),
        Fault(
            "planner_key_error",
            "the trainer's own chunk planner raises KeyError on a name",
            "CRASH",
            "trainer",
            {"model": "qwen3", **_SMALL},
            trainer.planner_key_error,
        ),
        Fault(
            "second_init_from_pp_stage",
            "the last PP stage's first rank sends a second /init_weight_transfer_engine",
            "CRASH",
            "trainer",
            {"model": "qwen3", "pp": 2, **_SMALL},
            trainer.second_init_from_pp_stage,
        ),
        Fault(
            "shm_segment_per_sync",
            "colocate: a new shared-memory segment per sync, the previous one closed but never unlinked",
            "RESOURCE_LEAK",
            "trainer",
            {"model": "qwen3", "colocate": True, **_SOAK},
            trainer.shm_segment_per_sync,
        ),
        Fault(
            "sender_keeps_packed_bytes",
            "the sender keeps a packed copy of every chunk it sent",
            "RESOURCE_LEAK",
            "trainer",
            {"model": "qwen3", **_SOAK},
            trainer.sender_keeps_packed_bytes,
        ),
        Fault(
            "engine_keeps_received_chunks",
            "the engine keeps a copy of every chunk it loaded",
            "RESOURCE_LEAK",
            "engine",
            {"model": "qwen3", "colocate": True, **_SOAK},
            engine.engine_keeps_received_chunks,
        ),
    ]
}


def fault_scenarios() -> list[dict[str, Any]]:
    """One scenario entry per fault, with `fault` and `expect` (what `python -m harness faults` runs)."""
    return [{**f.scenario, "fault": f.name, "expect": f.expect, "suffix": f"fault-{f.name}"} for f in FAULTS.values()]
