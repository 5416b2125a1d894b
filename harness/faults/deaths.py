"""Trainer-side fault injections that kill a rank's process below Python, where Ray tells the driver only
`ActorDiedError` and the harness must read the cause from the rank's own log (`harness.rank_logs`): gloo's
abort on a message of another size than the receive posted for it, and a segfault in native code, on the
sender or on a rank the sender waits for. Applied like every trainer fault (`harness.faults.trainer`): once
per rank process, through the named seams (`reference_impl.seams`) only; the rank that dies ends with its
scenario.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from reference_impl import seams


def _segfault_on(rank: int) -> None:
    """Read address 0 (SIGSEGV, as a faulty extension kernel would) when this process is trainer rank `rank`."""
    import ctypes

    import torch.distributed as dist

    if dist.get_rank() == rank:
        ctypes.string_at(0)


def handoff_one_element_more() -> None:
    """A PP stage hands the sender each of its tensors with one element more than the plan declared (a
    tensor padded after the plan was made, as a vocabulary padded to a multiple): the sender posts a
    receive of the planned size, and gloo aborts the sender's process inside its transport thread (an
    uncaught C++ exception, "Received data size doesn't match expected size"), below anything Python could
    catch."""

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def hand_off(plan, named, rank):  # type: ignore[no-untyped-def]
            padded = {n: torch.cat([t.detach().reshape(-1), t.detach().reshape(-1)[:1]]) for n, t in named.items()}
            orig(plan, padded, rank)

        return hand_off

    seams.replace("hand_off", make)


def stage_export_segfaults() -> None:
    """The last PP stage (rank 1 at PP 2) dies in native code as its export converts its first tensor (a
    segfault): its process ends below Python, while the sender, waiting for every rank's tensor metadata,
    fails with gloo's "Connection reset by peer", which names neither the dead rank nor why it died."""

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def convert(*args, **kwargs):  # type: ignore[no-untyped-def]
            _segfault_on(1)
            return orig(*args, **kwargs)

        return convert

    seams.replace("convert", make)


def bridge_export_segfaults() -> None:
    """Megatron-Bridge's export dies in native code on the last PP stage (rank 1 at PP 2) before it yields
    anything (a segfault). In a raw scenario only the second export path (the cross-mode oracle, after the
    last sync) runs it: the rank dies while the harness's oracle runs in it."""

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def export(export_mode, *args, **kwargs):  # type: ignore[no-untyped-def]
            if export_mode == "bridge":
                _segfault_on(1)
            return orig(export_mode, *args, **kwargs)

        return export

    seams.replace("export", make)
