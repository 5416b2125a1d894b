"""Engine-side fault injections: hooks the embedded engine's process loads at start (`--fault
harness.faults.engine:<name>`) or at an in-place restart, each replacing what runs at an engine seam
(`reference_impl.seams`).

The engine's own code has no fault branches: a hook is called once, before the server builds its
app, and changes the engine's behaviour until the next in-place restart undoes it (`seams.restore_all`,
then every engine seam compared with what ran there before any hook; the restart is refused otherwise).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from reference_impl import seams
from reference_impl.models.vllm_tp import Piece


def finalize_per_chunk() -> None:
    """After loading each chunk, every shard NOT in it is restored from a snapshot taken at
    /start_weight_update (a per-chunk finalize that reloads everything else): after a multi-chunk sync
    only the last chunk's tensors hold new values."""
    snapshots: dict[int, dict[str, torch.Tensor]] = {}

    def at_start(orig: Callable[..., Any]) -> Callable[..., Any]:
        def reset_counts(self):  # type: ignore[no-untyped-def]
            orig(self)
            with torch.no_grad():
                snapshots[id(self)] = {n: self.view(s).detach().clone() for n, s in self.shards.items()}

        return reset_counts

    def at_load(orig: Callable[..., Any]) -> Callable[..., Any]:
        def load(self, names, dtype_names, shapes, tensors):  # type: ignore[no-untyped-def]
            orig(self, names, dtype_names, shapes, tensors)
            snapshot = snapshots.get(id(self))
            if snapshot is None:
                return
            loaded = set(names)
            with torch.no_grad():
                for name, shard in self.shards.items():
                    if name not in loaded:
                        self.view(shard).copy_(snapshot[name])

        return load

    seams.replace("engine_session_start", at_start)
    seams.replace("engine_load", at_load)


def starts_from_checkpoint() -> None:
    """The engine starts holding the checkpoint's weights instead of dummy ones (a vLLM server started from
    the trainer's own checkpoint without `--load-format dummy`, or an engine reused from an earlier run
    that kept its weights): sync 0 then finds the checkpoint in the engine whatever the update moved."""

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def build(checkpoint, seed):  # type: ignore[no-untyped-def]
            from safetensors.torch import load_file
            from wsh_vllm_plugin.protocol import dtype_name

            from reference_impl.engine.embedded.loader import EngineLoader

            model, model_type = orig(checkpoint, seed)
            loader = EngineLoader(model, model_type)  # the engine's own placement of checkpoint tensors
            tensors: dict[str, torch.Tensor] = {}
            for f in sorted(Path(checkpoint).glob("*.safetensors")):
                tensors.update(load_file(f))
            names = [n for n in tensors if n in loader.shards]
            loader.load(
                names,
                [dtype_name(tensors[n].dtype) for n in names],
                [list(tensors[n].shape) for n in names],
                [tensors[n] for n in names],
            )
            return model, model_type

        return build

    seams.replace("engine_initial_weights", make)


def starts_from_other_weights() -> None:
    """The engine starts from weights other than its seed's (here the next seed's dummy weights; in the field,
    an engine process reused from an earlier run that kept or warm-started from that run's weights): nothing
    is the checkpoint's, so sync 0 still looks right, and a tensor a later update skips keeps a stale value."""

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def build(checkpoint, seed):  # type: ignore[no-untyped-def]
            return orig(checkpoint, seed + 1)

        return build

    seams.replace("engine_initial_weights", make)


def ok_without_transfer() -> None:
    """/update_weights receives each chunk's bytes but loads nothing, still counts the chunk's shards as
    updated and answers 200 (an HTTP 200 that moved nothing)."""

    def at_load(orig: Callable[..., Any]) -> Callable[..., Any]:
        def load(self, names, dtype_names, shapes, tensors):  # type: ignore[no-untyped-def]
            for name in names:
                self.counts[self.shards[name].target.key] += 1

        return load

    seams.replace("engine_load", at_load)


def exit_after_rejected_chunk() -> None:
    """The engine answers a rejected chunk, then its process dies at the next chunk it is sent (vLLM 0.32 on
    CPU: a failed layerwise reload leaves meta tensors and the next step kills the engine core): every later
    call finds nobody. The death follows the next chunk, not a clock, so it always lands in the sync loop of
    the run, however fast the host (a timer let a fast run finish its syncs and start its recovery first)."""
    answered = threading.Event()  # a rejection has gone out

    def at_validate(orig: Callable[..., Any]) -> Callable[..., Any]:
        def validate(self, names, dtype_names, shapes):  # type: ignore[no-untyped-def]
            if answered.is_set():
                os._exit(1)
            rejected, kinds = orig(self, names, dtype_names, shapes)
            if rejected:
                answered.set()
            return rejected, kinds

        return validate

    seams.replace("engine_validate", at_validate)


def exit_at_clean_sync() -> None:
    """The engine rejects a tied `lm_head` in each of the run's three syncs (the trainer's fault), answers the
    recovery probe, then dies at the next /start_weight_update: the clean sync the harness runs after the
    failed ones (with the trainer's fault undone) finds nobody. For the fault `engine_dies_in_clean_sync`,
    whose scenario has exactly three syncs, each with one rejected chunk."""
    rejections = [0]

    def at_validate(orig: Callable[..., Any]) -> Callable[..., Any]:
        def validate(self, names, dtype_names, shapes):  # type: ignore[no-untyped-def]
            rejected, kinds = orig(self, names, dtype_names, shapes)
            rejections[0] += bool(rejected)
            return rejected, kinds

        return validate

    def at_session_start(orig: Callable[..., Any]) -> Callable[..., Any]:
        def reset_counts(self):  # type: ignore[no-untyped-def]
            if rejections[0] >= 3:  # the three syncs are over: this is the clean sync's session
                os._exit(1)
            return orig(self)

        return reset_counts

    seams.replace("engine_validate", at_validate)
    seams.replace("engine_session_start", at_session_start)


def weight_version_not_committed() -> None:
    """/finish_weight_update loads the weights but never commits the new version: the engine keeps
    reporting (and tagging its rollouts with) the version it started with."""
    seams.replace("engine_commit_version", lambda orig: lambda self, version: None)


def completions_tagged_with_first_version() -> None:
    """The engine tags every completion with the weight version of the first one it served (a tag taken once,
    when the serving path was set up): /weight_info reports each new version, while the rollouts after an
    update are attributed to the policy the engine started with."""
    first: list[int] = []

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def complete(self, req, inputs, weight_version):  # type: ignore[no-untyped-def]
            if not first:
                first.append(weight_version)
            return orig(self, req, inputs, first[0])

        return complete

    seams.replace("engine_complete", make)


def version_committed_at_start() -> None:
    """/start_weight_update commits the weight version it names at once instead of leaving that to the finish:
    while the update's chunks are still arriving, /weight_info (and the completions' tags) claim weights that
    are not loaded yet. Once the sync finished, the version is right again."""

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def open_session(self, version):  # type: ignore[no-untyped-def]
            orig(self, version)
            if version is not None:
                self.commit_version(version)

        return open_session

    seams.replace("engine_open_session", make)


def completions_served_during_session() -> None:
    """The engine's refusal of completions checks only a pause, not an open update session: a completion
    between two chunks is served from half-updated weights (and tagged with the version before)."""

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def serving_refusal(self):  # type: ignore[no-untyped-def]
            return "the engine is paused" if self.paused else None

        return serving_refusal

    seams.replace("engine_serving_refusal", make)


def tp_row_split_as_column() -> None:
    """The engine's TP ranks split the row-parallel layers (`o_proj`, `down_proj`) along their output rows
    instead of their input columns: each rank keeps a wrong piece, though the pieces still tile the tensor
    (a vLLM worker would then compute its partial sums from the wrong half of the matrix)."""

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def pieces(kind, shard, shape, rank, tp, dims):  # type: ignore[no-untyped-def]
            if kind != "row":
                return orig(kind, shard, shape, rank, tp, dims)
            rows = shape[0] // tp
            return Piece(dim=0, src_start=rank * rows, size=rows, dst_offset=0, shard_shape=(rows, shape[1]))

        return pieces

    seams.replace("engine_tp_pieces", make)


def engine_keeps_received_chunks() -> None:
    """The engine keeps a copy of every chunk it loaded (a received-chunk list that is never cleared after
    /finish_weight_update): the engine's memory grows by the model's bytes per sync."""
    kept: list[list[torch.Tensor]] = []

    def at_load(orig: Callable[..., Any]) -> Callable[..., Any]:
        def load(self, names, dtype_names, shapes, tensors):  # type: ignore[no-untyped-def]
            orig(self, names, dtype_names, shapes, tensors)
            kept.append([t.clone() for t in tensors])

        return load

    seams.replace("engine_load", at_load)
