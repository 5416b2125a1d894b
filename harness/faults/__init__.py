"""Named fault injections: historical bug classes of weight-sync paths, for the harness's mutation tests.

Faults are test equipment and live only here. Each is a small documented change applied inside the
processes of ONE scenario only (never in normal runs), always through the named seams of the system
under test (`reference_impl.seams`):

- trainer side (`faults.trainer`; `faults.deaths`, those that kill a rank's process below Python): a
  function the runner calls in every trainer rank's process
  (`TrainerWorker.run_in_process`); after a scenario that ran through or recovered cleanly from a failed
  sync (`harness.outcome.in_step`), the runner undoes it (`seams.restore_all`) and keeps those processes
  only when their seams run what they ran at their start and no shared-memory segment appeared since the
  sender connected; otherwise it ends them;
- engine side (`faults.engine`): a hook `MODULE:FUNCTION` the engine process loads at start (`--fault`)
  or at an in-place restart, for engines whose adapter declares `fault_hooks`; the next restart undoes it.

Every fault names the scenario that shows it and the verdict the harness must give;
`fault_scenarios()` turns the registry into scenarios with `fault:` and `expect:`, and
`python -m harness faults` runs them all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harness.faults import deaths, engine, trainer


@dataclass(frozen=True)
class Fault:
    """One fault: what bug it reproduces, how it is injected, and the verdict it must produce.

    `trainer` is applied in every trainer rank's process (a function of `faults.trainer` or `faults.deaths`),
    `engine` is the hook the engine loads at start or restart (a function of `faults.engine`); a fault has
    one or both.
    """

    name: str
    description: str
    expect: str
    scenario: dict[str, Any] = field(default_factory=dict)  # fields of the scenario that shows it
    trainer: Callable[[], None] | None = None
    engine: Callable[[], None] | None = None

    @property
    def hook(self) -> str | None:
        """The `MODULE:FUNCTION` the engine loads (`--fault` at start, `fault` at a restart), None without an
        engine side."""
        return f"{self.engine.__module__}:{self.engine.__name__}" if self.engine is not None else None


_SMALL = {"syncs": 2, "chunk_bytes": 65536}
# Real vLLM, for the sender's bugs that only an engine serving between chunks shows (at temperature 1.0: vLLM's
# prompt log-probs do not honour another).
_VLLM_SMALL = {"model": "qwen3", "engine": "vllm", "logprob_temperature": 1.0, **_SMALL}
# Long enough for the resource check to fit a slope after its warm-up half (`checks.resources`).
_SOAK = {"syncs": 12, "chunk_bytes": 65536}
# A leak of a copy per sync must stand out of a process's allocator noise (its RSS moved 10-16 MB between two
# samples under load): qwen3-moe moves 7.6 MB per sync, qwen3 1.1 MB (whose kept chunks once went unseen).

FAULTS: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            "pp_barrier_in_chunk_loop",
            "a barrier inside the per-chunk loop while PP stages have different chunk counts",
            "DEADLOCK",
            {"model": "qwen3", "pp": 2, "deadline_s": 10, **_SMALL},
            trainer=trainer.pp_barrier_in_chunk_loop,
        ),
        Fault(
            "legacy_vision_names",
            "vision parameters sent as model.visual. + the Megatron suffix",
            "NAME_ERROR",
            {"model": "qwen3-vl", **_SMALL},
            trainer=trainer.legacy_vision_names,
        ),
        Fault(
            "noncolocate_ignores_bridge",
            "bridge requested, the raw path used in non-colocate mode",
            "PARITY_FAIL",
            {"model": "qwen3", "export_mode": "bridge", **_SMALL},
            trainer=trainer.noncolocate_ignores_bridge,
        ),
        Fault(
            "gqa_split_wrong",
            "q/k/v split as contiguous blocks instead of head_dim query groups",
            "PARITY_FAIL",
            {"model": "qwen3", **_SMALL},
            trainer=trainer.gqa_split_wrong,
        ),
        Fault(
            "ep_local_expert_ids",
            "local expert ids sent as global at EP = 2: EP rank 1's experts take rank 0's names",
            "CRASH",
            {"model": "qwen3-moe", "ep": 2, **_SMALL},
            trainer=trainer.ep_local_expert_ids,
        ),
        Fault(
            "ep_rank_experts_unsent",
            "at EP = 2 only EP rank 0 exports routed experts (as if EP had gathered every expert to it)",
            "COVERAGE_GAP",
            {"model": "qwen3-moe", "ep": 2, **_SMALL},
            trainer=trainer.ep_rank_experts_unsent,
        ),
        Fault(
            "drop_last_chunk",
            "the last chunk is never sent",
            "CHUNK_MISMATCH",
            {"model": "qwen3", **_SMALL},
            trainer=trainer.drop_last_chunk,
        ),
        Fault(
            "finalize_per_chunk",
            "the engine restores parameters not in the current chunk on each update",
            "PARITY_FAIL",
            {"model": "qwen3", **_SMALL},
            engine=engine.finalize_per_chunk,
        ),
        Fault(
            "tied_lm_head_sent",
            "a separate lm_head sent to an engine with tied embeddings",
            "NAME_ERROR",
            {"model": "qwen3", **_SMALL},
            trainer=trainer.tied_lm_head_sent,
        ),
        Fault(
            "ok_without_transfer",
            "the engine answers 200 to /update_weights without loading what it received",
            "PARITY_FAIL",
            {"model": "qwen3", **_SMALL},
            engine=engine.ok_without_transfer,
        ),
        Fault(
            "engine_starts_from_checkpoint",
            "the engine starts holding the checkpoint's weights instead of dummy ones: sync 0 proves nothing",
            "PARITY_FAIL",
            {"model": "qwen3", **_SMALL},
            engine=engine.starts_from_checkpoint,
        ),
        Fault(
            "engine_starts_from_other_weights",
            "the engine starts from weights other than its seed's (as one reused with an earlier run's weights)",
            "PARITY_FAIL",
            {"model": "qwen3", **_SMALL},
            engine=engine.starts_from_other_weights,
        ),
        Fault(
            "wrong_dtype",
            "chunks declared bfloat16 but sent as float32",
            "HTTP_ERROR",
            {"model": "qwen3", **_SMALL},
            trainer=trainer.wrong_dtype,
        ),
        Fault(
            "chunk_index_not_reset",
            "chunk indexes come from one counter never reset between syncs: the wire and the sender's record differ "
            "from sync 1 on",
            "CHUNK_MISMATCH",
            {"model": "qwen3", **_SMALL},
            trainer=trainer.chunk_index_not_reset,
        ),
        Fault(
            "plan_skips_an_index",
            "the planner numbers the last chunk one past its place: indexes skip one, on the wire and in the record",
            "CHUNK_MISMATCH",
            {"model": "qwen3", "pp": 2, **_SMALL},
            trainer=trainer.plan_skips_an_index,
        ),
        Fault(
            "plan_overfills_a_chunk",
            "the planner puts the last two chunks' tensors into one, over chunk_bytes",
            "CHUNK_MISMATCH",
            {"model": "qwen3", "pp": 2, **_SMALL},
            trainer=trainer.plan_overfills_a_chunk,
        ),
        Fault(
            "gather_buffers_keyed_by_size",
            "the raw export's kept gather buffers are shared by parameters of one shape: each layer's gather "
            "overwrites the layer before it while its chunk still waits",
            "PARITY_FAIL",
            {"model": "qwen3", "tp": 2, "syncs": 2, "chunk_bytes": 64 << 20},  # one chunk: every tensor waits
            trainer=trainer.gather_buffers_keyed_by_size,
        ),
        Fault(
            "ipc_buffer_reused_early",
            "the colocate producer overwrites its buffer before the engine acknowledged the chunk",
            "PARITY_FAIL",
            {"model": "qwen3", "colocate": True, **_SMALL},
            trainer=trainer.ipc_buffer_reused_early,
        ),
        Fault(
            "fused_drops_visual_kwargs",
            "the fused log-prob forward no longer passes visual_pos_masks / deepstack embeddings to the language model",
            "PARITY_FAIL",
            {"model": "qwen3-vl", **_SMALL},
            trainer=trainer.fused_drops_visual_kwargs,
        ),
        Fault(
            "temperature_not_passed",
            "the sampling temperature never reaches the trainer's fused log-prob path",
            "PARITY_FAIL",
            {"model": "qwen3-vl", **_SMALL},
            trainer=trainer.temperature_not_passed,
        ),
        Fault(
            "position_ids_wrong_shape",
            "[batch, seq] position ids handed to the trainer-side mRoPE forward, which raises: its oracle "
            "could not run, the verdict comes from the other checks",
            "PASS",
            {"model": "qwen3-vl", **_SMALL, "expect_note": "oracle could not run"},
            trainer=trainer.position_ids_wrong_shape,
        ),
        Fault(
            "stale_cache_in_sync_loop",
            "the sync loop re-sends the tensors it cached at sync 0 at every later sync",
            "PARITY_FAIL",
            {"model": "qwen3", "pp": 2, "export_mode": "bridge", "syncs": 3, "chunk_bytes": 65536},
            trainer=trainer.stale_cache_in_sync_loop,
        ),
        Fault(
            "step_skips_one_parameter",
            "the trainer's step never reaches one parameter (the final norm)",
            "PARITY_FAIL",
            {"model": "qwen3", "syncs": 3, "chunk_bytes": 65536},
            trainer=trainer.step_skips_one_parameter,
        ),
        Fault(
            "transposed_fused_experts",
            "Qwen3-VL-MoE's fused expert tensors sent with their last two dims swapped",
            "HTTP_ERROR",
            {"model": "qwen3-vl-moe", "ep": 2, **_SMALL},
            trainer=trainer.transposed_fused_experts,
        ),
        Fault(
            "planner_key_error",
            "the trainer's own chunk planner raises KeyError on a name",
            "CRASH",
            {"model": "qwen3", **_SMALL},
            trainer=trainer.planner_key_error,
        ),
        Fault(
            "second_init_from_pp_stage",
            "the last PP stage's first rank sends a second /init_weight_transfer_engine",
            "CRASH",
            {"model": "qwen3", "pp": 2, **_SMALL},
            trainer=trainer.second_init_from_pp_stage,
        ),
        Fault(
            "handoff_one_element_more",
            "a PP stage hands the sender each tensor one element longer than planned: gloo aborts the sender",
            "CRASH",
            {"model": "qwen3", "pp": 2, **_SMALL},
            trainer=deaths.handoff_one_element_more,
        ),
        Fault(
            "stage_export_segfaults",
            "the last PP stage segfaults in its export while the sender waits on it in a collective",
            "CRASH",
            {"model": "qwen3", "pp": 2, **_SMALL},
            trainer=deaths.stage_export_segfaults,
        ),
        Fault(
            "bridge_export_segfaults",
            "the bridge export segfaults on the last PP stage; in a raw scenario only the cross-mode oracle runs it",
            "CRASH",
            {"model": "qwen3", "pp": 2, **_SMALL},
            trainer=deaths.bridge_export_segfaults,
        ),
        Fault(
            "bridge_built_from_config",
            "the bridge mode exports through an AutoBridge built from the HF config alone (tied embeddings)",
            "NAME_ERROR",
            {"model": "qwen3", "export_mode": "bridge", **_SMALL},
            trainer=trainer.bridge_built_from_config,
        ),
        Fault(
            "engine_dies_after_rejected_chunk",
            "a lm_head sent to a tied engine, which answers the rejection and then dies",
            "CRASH",
            {"model": "qwen3", **_SMALL},
            trainer=trainer.tied_lm_head_sent,
            engine=engine.exit_after_rejected_chunk,
        ),
        Fault(
            "engine_dies_in_clean_sync",
            "a lm_head sent to a tied engine in each of three syncs; the engine survives them, answers the "
            "recovery probe, then dies as the clean sync starts",
            "CRASH",
            {"model": "qwen3", **_SMALL},
            trainer=trainer.tied_lm_head_sent,
            engine=engine.exit_at_clean_sync,
        ),
        Fault(
            "wrong_dtype_once",
            "chunks declared bfloat16 for float32 bytes in sync 1 only: the engine refuses them, then recovers",
            "HTTP_ERROR",
            {"model": "qwen3", "syncs": 3, "chunk_bytes": 65536, "fault_sync": 1},
            trainer=trainer.wrong_dtype,
        ),
        Fault(
            "no_prefix_cache_reset",
            "after an update the sender resets the encoder cache but not the prefix cache",
            "PARITY_FAIL",
            {"model": "qwen3", "syncs": 3, "chunk_bytes": 65536},
            trainer=trainer.no_prefix_cache_reset,
        ),
        Fault(
            "encoder_cache_survives_update",
            "after an update the sender resets only the prefix cache: old image features are reused",
            "PARITY_FAIL",
            {"model": "qwen3-vl", "syncs": 3, "chunk_bytes": 65536},
            trainer=trainer.encoder_cache_survives_update,
        ),
        Fault(
            "duplicate_rank_offsets",
            "two engine replicas sent the same rank offset in one transfer group",
            "DEADLOCK",
            {"model": "qwen3", "engines": 2, "deadline_s": 10, **_SMALL},
            trainer=trainer.duplicate_rank_offsets,
        ),
        Fault(
            "tp_row_split_as_column",
            "the engine's TP ranks split o_proj / down_proj by output rows instead of input columns",
            "PARITY_FAIL",
            {"model": "qwen3", "engine_tp": 2, **_SMALL},
            engine=engine.tp_row_split_as_column,
        ),
        Fault(
            "weight_version_not_committed",
            "the engine loads the weights but /finish_weight_update never commits the new version",
            "PARITY_FAIL",
            {"model": "qwen3", **_SMALL},
            engine=engine.weight_version_not_committed,
        ),
        Fault(
            "completions_tagged_with_first_version",
            "the engine commits every new version but tags its completions with the first one it served",
            "PARITY_FAIL",
            {"model": "qwen3", **_SMALL},
            engine=engine.completions_tagged_with_first_version,
        ),
        Fault(
            "version_committed_at_start",
            "/start_weight_update commits the version it names at once: /weight_info claims it while the "
            "update's chunks are still arriving (right again once finished)",
            "PARITY_FAIL",
            {"model": "qwen3", **_SMALL},
            engine=engine.version_committed_at_start,
        ),
        Fault(
            "completions_served_during_session",
            "the engine serves completions while an update session is open (its refusal checks only a "
            "pause): a rollout between two chunks runs on half-updated weights",
            "PARITY_FAIL",
            {"model": "qwen3", **_SMALL},
            engine=engine.completions_served_during_session,
        ),
        Fault(
            "generation_not_paused",
            "the sender opens the update session without pausing vLLM's generation, which serves requests "
            "between chunks",
            "PARITY_FAIL",
            _VLLM_SMALL,
            trainer=trainer.generation_not_paused,
        ),
        Fault(
            "generation_resumed_mid_update",
            "the sender resumes vLLM's generation once the update's second chunk is answered, the session still open",
            "PARITY_FAIL",
            _VLLM_SMALL,
            trainer=trainer.generation_resumed_mid_update,
        ),
        Fault(
            "shm_segment_per_sync",
            "colocate: a new shared-memory segment per sync, the previous one closed but never unlinked",
            "RESOURCE_LEAK",
            {"model": "qwen3", "colocate": True, **_SOAK},
            trainer=trainer.shm_segment_per_sync,
        ),
        Fault(
            "sender_keeps_packed_bytes",
            "the sender keeps a packed copy of every chunk it sent",
            "RESOURCE_LEAK",
            {"model": "qwen3-moe", **_SOAK},
            trainer=trainer.sender_keeps_packed_bytes,
        ),
        Fault(
            "engine_keeps_received_chunks",
            "the engine keeps a copy of every chunk it loaded",
            "RESOURCE_LEAK",
            {"model": "qwen3-moe", "colocate": True, **_SOAK},
            engine=engine.engine_keeps_received_chunks,
        ),
    ]
}


def fault_scenarios() -> list[dict[str, Any]]:
    """One scenario entry per fault, with `fault` and `expect` (what `python -m harness faults` runs)."""
    return [{**f.scenario, "fault": f.name, "expect": f.expect, "suffix": f"fault-{f.name}"} for f in FAULTS.values()]
