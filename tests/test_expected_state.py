"""The expected state (`harness.oracles.expected`): what is read from it is kept per checkpoint, seed and
steps, and a kept value equals what the checkpoint and the trainer's step give when computed anew."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.oracles import expected
from harness.oracles.expected import ExpectedState
from reference_impl.checksum import tensor_checksum
from reference_impl.models.checkpoint import make_checkpoint
from reference_impl.models.registry import load_model
from reference_impl.trainer.step import step


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A copy of the tiny Qwen3 checkpoint (this test touches its file)."""
    src = make_checkpoint(load_model("qwen3"), 1234)
    dst = tmp_path / "ckpt"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _by_hand(checkpoint: Path, seed: int, steps: tuple[int, ...]) -> dict[str, str]:
    """The checksums after `steps`, from the safetensors file and `step` alone."""
    tensors = load_file(checkpoint / "model.safetensors")
    for k in steps:
        tensors = {n: step(t, k, seed) for n, t in tensors.items()}
    return {n: tensor_checksum(t) for n, t in tensors.items()}


def test_a_later_state_of_the_same_checkpoint_and_seed_is_not_built_again(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(expected, "_KEPT", {})
    first = ExpectedState(checkpoint, 7)
    assert first.checksums() == _by_hand(checkpoint, 7, ())
    assert first.advance(1).checksums() == _by_hand(checkpoint, 7, (1,))  # as a scenario reads every sync's
    assert first.advance(2).checksums() == _by_hand(checkpoint, 7, (1, 2))

    def no_read(path: Path) -> dict[str, torch.Tensor]:
        raise AssertionError(f"read {path} again")

    monkeypatch.setattr(expected, "read_checkpoint", no_read)
    again = ExpectedState(checkpoint, 7)
    assert again.advance(1).advance(2).checksums() == _by_hand(checkpoint, 7, (1, 2))  # kept: nothing read
    assert again.kept("view", lambda: [1.0]) == [1.0] and again.kept("view", lambda: [2.0]) == [1.0]
    with pytest.raises(AssertionError, match="read"):
        ExpectedState(checkpoint, 8).advance(1)  # another seed is another state: built
    with pytest.raises(AssertionError, match="read"):
        ExpectedState(checkpoint, 7).advance(2)  # other steps too


def test_a_rewritten_checkpoint_is_another_state(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(expected, "_KEPT", {})
    before = ExpectedState(checkpoint, 7).checksums()
    tensors = load_file(checkpoint / "model.safetensors")
    name = "model.norm.weight"
    tensors[name] = tensors[name] + 1
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    os.utime(checkpoint / "model.safetensors", ns=(1, 1))  # a new modification time, whatever the clock
    after = ExpectedState(checkpoint, 7).checksums()
    assert after == _by_hand(checkpoint, 7, ()) and after[name] != before[name]


def test_what_a_caller_edits_is_not_what_a_later_scenario_reads(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(expected, "_KEPT", {})
    sums = ExpectedState(checkpoint, 7).checksums()
    sums["model.norm.weight"] = "edited"
    assert ExpectedState(checkpoint, 7).checksums()["model.norm.weight"] != "edited"
