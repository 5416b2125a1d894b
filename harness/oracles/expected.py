"""The expected state after every sync, from the checkpoint alone.

Sync 0 must leave the checkpoint's tensors; before each later sync k (< syncs) the trainer applies
`reference_impl.trainer.step.step(·, k, seed)` to every parameter, and that step is elementwise, so
applying it to the checkpoint's HF tensors gives what every export of the trainer's state must be, bit
for bit, whatever the layout (`trainer/step.py` says why). The re-sync after the last sync sends
unchanged weights: its expected state is the previous one. Nothing here imports the exporter, the
sender or the engine.
"""

from __future__ import annotations

from pathlib import Path

import torch

from reference_impl.checksum import tensor_checksum
from reference_impl.models.checkpoint import read_checkpoint
from reference_impl.trainer.step import step


class ExpectedState:
    """The HF tensors the trainer's state must export to, advanced sync by sync.

    Args:
        checkpoint: the scenario's checkpoint folder (the state of sync 0).
        seed: the scenario's seed (the trainer steps with it).
    """

    def __init__(self, checkpoint: Path, seed: int) -> None:
        self.seed = seed
        self.tensors: dict[str, torch.Tensor] = read_checkpoint(checkpoint)
        self.index = 0

    def advance(self, k: int) -> ExpectedState:
        """Apply the trainer's step k to every tensor (the change the trainer makes before sync k); returns
        this state."""
        for name, t in self.tensors.items():
            self.tensors[name] = step(t, k, self.seed)
        self.index = k
        return self

    def checksums(self) -> dict[str, str]:
        """HF name -> `tensor_checksum` of the current expected tensors."""
        return {name: tensor_checksum(t) for name, t in self.tensors.items()}
