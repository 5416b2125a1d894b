"""The expected state after every sync, from the checkpoint alone.

Sync 0 must leave the checkpoint's tensors; before each later sync k (< syncs) the trainer applies
`reference_impl.trainer.step.step(·, k, seed)` to every parameter, and that step is elementwise, so
applying it to the checkpoint's HF tensors gives what every export of the trainer's state must be, bit
for bit, whatever the layout (`trainer/step.py` says why). The re-sync after the last sync sends
unchanged weights: its expected state is the previous one. Nothing here imports the exporter, the
sender or the engine.

The state after steps (k1, ..., kn) is a function of the checkpoint's bytes, the seed and those steps
only, never of the scenario's layout, export mode, engine or fault. So what is read from it (its
checksums, the log-probs of a forward over it) is kept for the process's life, keyed by exactly that
(`ExpectedState.key`), and its tensors are built only when something not yet kept needs them: the
scenarios of one model in a matrix pay for the state once (a 0.6B model: about 5 s a step and 3 s a
log-prob view on a 2-core host) instead of once each.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, TypeVar

import torch

from harness.oracles.digest import tensor_digest
from reference_impl.models.checkpoint import read_checkpoint
from reference_impl.trainer.step import step

T = TypeVar("T")

# ExpectedState.key -> what was read from that state (checksums; views by what they are), for this process
_KEPT: dict[tuple[Hashable, ...], Any] = {}


def checkpoint_identity(checkpoint: Path) -> tuple[Hashable, ...]:
    """What identifies a checkpoint's bytes without reading them: its resolved folder and each safetensors
    file's name, size and modification time (ns)."""
    files = sorted(checkpoint.glob("*.safetensors"))
    stats = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return (str(checkpoint.resolve()), stats)


class ExpectedState:
    """The HF tensors the trainer's state must export to, advanced sync by sync.

    Args:
        checkpoint: the scenario's checkpoint folder (the state of sync 0).
        seed: the scenario's seed (the trainer steps with it).
    """

    def __init__(self, checkpoint: Path, seed: int) -> None:
        self.checkpoint, self.seed = checkpoint, seed
        self.steps: tuple[int, ...] = ()
        self._identity = checkpoint_identity(checkpoint)
        self._tensors: dict[str, torch.Tensor] | None = None
        self._applied = 0  # how many of `steps` `_tensors` has had applied

    @property
    def index(self) -> int:
        """The last step applied (0: the checkpoint itself)."""
        return self.steps[-1] if self.steps else 0

    @property
    def key(self) -> tuple[Hashable, ...]:
        """(checkpoint identity, seed, steps applied): equal keys are equal states, bit for bit."""
        return (self._identity, self.seed, self.steps)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """HF name -> expected tensor (the checkpoint's dtype), built on first use: read from the checkpoint
        and stepped by every step not applied yet."""
        if self._tensors is None:
            self._tensors, self._applied = read_checkpoint(self.checkpoint), 0
        for k in self.steps[self._applied :]:
            for name, t in self._tensors.items():
                self._tensors[name] = step(t, k, self.seed)
        self._applied = len(self.steps)
        return self._tensors

    def advance(self, k: int) -> ExpectedState:
        """Apply the trainer's step k (the change the trainer makes before sync k); returns this state. The
        tensors are stepped now (the caller runs this while the ranks step) unless this state's checksums are
        already kept, i.e. an earlier scenario of this checkpoint and seed read them."""
        self.steps = (*self.steps, k)
        if (*self.key, "checksums") not in _KEPT:
            _ = self.tensors
        return self

    def checksums(self) -> dict[str, str]:
        """HF name -> `harness.oracles.digest.tensor_digest` of the current expected tensors."""
        return self.kept("checksums", lambda: {name: tensor_digest(t) for name, t in self.tensors.items()})

    def kept(self, what: Hashable, compute: Callable[[], T]) -> T:
        """`compute()` of this state, kept under (`key`, `what`) for the process's life (`what` must say
        everything besides the state that the result depends on); a copy is returned, so a caller's edits
        never reach a later scenario."""
        key = (*self.key, what)
        if key not in _KEPT:
            _KEPT[key] = compute()
        return copy.deepcopy(_KEPT[key])
