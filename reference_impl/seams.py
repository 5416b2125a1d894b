"""The named seams of the weight-sync path: the only places where a fault injection may replace code.

A seam is a module attribute that production code calls through its module (so replacing the attribute
changes what runs; a method of a Ray actor's class is not one: Ray binds an actor's methods when it
creates the actor) and that has a purpose of its own on the sync path; nothing here exists only to be
patched. The harness's fault injections (`harness/faults/`) reach the system under test through
`replace` and nothing else: a fault names the seam it changes, and a seam that moves breaks loudly here
instead of silently patching nothing.

Trainer side (replaced inside the trainer rank processes of one scenario):

| seam | what runs there |
| --- | --- |
| `talks_to_engine` | which trainer rank sets up the channel to the engine (/init_weight_transfer_engine) |
| `train_step` | the trainer's step between syncs over every (global name, parameter) |
| `convert` | raw export: one full Megatron parameter -> its HF (name, tensor) pairs |
| `export` | the export mode dispatch (raw / bridge) |
| `global_params` | raw export: this rank's (global name, parameter) pairs (PP layer offsets, EP expert ids) |
| `ep_gather` | one local expert's tensor from every EP rank (families that stack experts) |
| `gather_buffer` | the raw export's kept buffer a gather writes a parameter's full tensor into |
| `plan_chunks` | the chunk (bucket) plan every rank computes |
| `update_info` | one chunk's `update_info` body |
| `send_chunk` | the sender hands one chunk to its channel |
| `rank_offsets` | each engine replica's rank offset in the transfer group |
| `pause_generation` | before the update session, the sender pauses an engine that serves between chunks (vLLM) |
| `finish_update` | once every chunk was answered, the sender closes the update session (/finish_weight_update) |
| `reset_engine_caches` | after a finished update, the sender resets the engine's prefix and encoder caches |
| `hand_off` / `collect` | non-sender ranks hand their tensors to the sender / the sender collects them |
| `colocate_pack` | the colocate producer packs a chunk into its shared buffer |
| `megatron_forward_kwargs` | the trainer's log-prob forward: one prompt's inputs to the Megatron model |
| `megatron_logprobs_kernel` | the trainer's vocab-parallel fused log-prob kernel (takes the temperature) |

Engine side (replaced inside the embedded engine's process by a fault hook it loads at start or at an
in-place restart, which the next restart undoes):

| seam | what runs there |
| --- | --- |
| `engine_initial_weights` | the model the engine starts with: the checkpoint's architecture, its seed's dummy weights |
| `engine_validate` | the loader checks a chunk's names, dtypes and shapes before anything is loaded |
| `engine_load` | the loader copies one validated chunk into the engine's parameters |
| `engine_commit_version` | /finish_weight_update commits the new weight version |
| `engine_complete` | the engine serves one completion (generated tokens, log-probs, the weight version it tags) |
| `engine_session_start` | the loader's per-session reset at /start_weight_update |
| `engine_open_session` | /start_weight_update opens the update session (the version is committed only at finish) |
| `engine_serving_refusal` | why the engine refuses a completion now (an open update session, a pause), or None |
| `engine_tp_pieces` | which piece of a checkpoint tensor each of the engine's TP ranks keeps (vLLM's partition) |
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

SEAMS: dict[str, tuple[str, str]] = {
    "talks_to_engine": ("reference_impl.worker", "talks_to_engine"),
    "train_step": ("reference_impl.trainer.step", "apply"),
    "convert": ("reference_impl.export.stream", "convert"),
    "export": ("reference_impl.export.stream", "export"),
    "global_params": ("reference_impl.export.stream", "iter_global_params"),
    "ep_gather": ("reference_impl.export.stream", "ep_gather"),
    "gather_buffer": ("reference_impl.trainer.params", "GatherBuffers.kept"),
    "plan_chunks": ("reference_impl.transport.sync", "plan_chunks"),
    "update_info": ("reference_impl.transport.sync", "update_info"),
    "send_chunk": ("reference_impl.transport.sync", "send_chunk"),
    "pause_generation": ("reference_impl.transport.sync", "pause_generation"),
    "finish_update": ("reference_impl.transport.sync", "finish_update"),
    "reset_engine_caches": ("reference_impl.transport.sync", "reset_engine_caches"),
    "rank_offsets": ("reference_impl.transport.group", "rank_offsets"),
    "hand_off": ("reference_impl.transport.sync", "hand_off"),
    "collect": ("reference_impl.transport.sync", "collect"),
    "colocate_pack": ("reference_impl.transport.colocate", "pack"),
    "megatron_forward_kwargs": ("reference_impl.forward.megatron", "forward_kwargs"),
    "megatron_logprobs_kernel": ("reference_impl.forward.megatron", "vocab_parallel_logprobs"),
    "engine_initial_weights": ("reference_impl.engine.embedded.loader", "build_engine_model"),
    "engine_validate": ("reference_impl.engine.embedded.loader", "EngineLoader.validate"),
    "engine_load": ("reference_impl.engine.embedded.loader", "EngineLoader.load"),
    "engine_commit_version": ("reference_impl.engine.embedded.server", "EngineState.commit_version"),
    "engine_complete": ("reference_impl.engine.embedded.completions", "CompletionEngine.complete"),
    "engine_session_start": ("reference_impl.engine.embedded.loader", "EngineLoader.reset_counts"),
    "engine_open_session": ("reference_impl.engine.embedded.server", "EngineState.open_session"),
    "engine_serving_refusal": ("reference_impl.engine.embedded.server", "EngineState.serving_refusal"),
    "engine_tp_pieces": ("reference_impl.models.vllm_tp", "pieces"),
}
# The seams of each side (the tables above; engine seams are named engine_*): what a trainer rank process,
# or the embedded engine's process, can have replaced.
TRAINER_SEAMS = tuple(name for name in SEAMS if not name.startswith("engine_"))
ENGINE_SEAMS = tuple(name for name in SEAMS if name.startswith("engine_"))


def _owner(seam: str) -> tuple[Any, str]:
    """(object that holds the seam's attribute, attribute name).

    Raises:
        KeyError: an unknown seam (the message lists the known ones).
    """
    if seam not in SEAMS:
        raise KeyError(f"no seam named {seam!r}; known seams: {', '.join(SEAMS)}")
    module_name, path = SEAMS[seam]
    owner: Any = importlib.import_module(module_name)
    *parents, attr = path.split(".")
    for name in parents:
        owner = getattr(owner, name)
    if not hasattr(owner, attr):
        raise KeyError(f"seam {seam!r}: {module_name} has no {path} (the seam moved; update reference_impl.seams)")
    return owner, attr


def current(seam: str) -> Callable[..., Any]:
    """What runs at `seam` now."""
    owner, attr = _owner(seam)
    return getattr(owner, attr)


_ORIGINALS: dict[str, Callable[..., Any]] = {}  # what ran at each replaced seam before its first replacement


def replace(seam: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[..., Any]:
    """Replace what runs at `seam` by `make(current)` in this process; returns the previous callable.

    Raises:
        KeyError: an unknown or moved seam.
    """
    owner, attr = _owner(seam)
    previous = getattr(owner, attr)
    _ORIGINALS.setdefault(seam, previous)
    setattr(owner, attr, make(previous))
    return previous


def put_back(seam: str, previous: Callable[..., Any]) -> None:
    """Undo one `replace` of `seam` whose return was `previous` (what ran there before it): the seam runs
    `previous` again, and once that is the original, `restore_all` no longer lists the seam.

    Raises:
        KeyError: an unknown or moved seam.
    """
    owner, attr = _owner(seam)
    setattr(owner, attr, previous)
    if _ORIGINALS.get(seam) is previous:
        del _ORIGINALS[seam]


def restore_all() -> list[str]:
    """Put back what ran at every replaced seam (undo every fault in this process); returns their names."""
    restored = list(_ORIGINALS)
    for seam, original in _ORIGINALS.items():
        owner, attr = _owner(seam)
        setattr(owner, attr, original)
    _ORIGINALS.clear()
    return restored


def snapshot(names: tuple[str, ...] = TRAINER_SEAMS) -> dict[str, Callable[..., Any]]:
    """What runs at each seam of `names` now, to compare with later (`replaced_since`). Taken by a process
    before any fault is applied to it, it is what that process runs unfaulted.

    Raises:
        KeyError: an unknown or moved seam.
    """
    return {name: current(name) for name in names}


def replaced_since(taken: dict[str, Callable[..., Any]]) -> list[str]:
    """The seams of `taken` (a `snapshot`) at which something else runs now, by identity: after a fault
    was applied and undone, a seam listed here still runs the fault's code (or another replacement). It
    reads the seams' attributes, not `replace`'s own record of what it replaced."""
    return [name for name, fn in taken.items() if current(name) is not fn]
