"""The sender held mid-session (`harness.mid_session`): it stops after its first answered chunk until the
harness releases it, once, and `disarm` leaves the seam as it was. What the engines answer then is judged in
tests/checks/test_engine_state.py; the e2e runs (tests/test_e2e.py, tests/test_faults.py) ask real engines."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from harness import mid_session
from reference_impl import seams
from reference_impl.transport import sync


class _Channel:
    def __init__(self) -> None:
        self.sent: list[int] = []

    def send(self, client: Any, tensors: list[Any], info: Any, sync_index: int) -> dict[str, Any]:
        self.sent.append(sync_index)
        return {"ok": True, "chunk": len(self.sent) - 1}


def test_the_sender_holds_once_after_its_first_answered_chunk_until_released(tmp_path: Path) -> None:
    gate = mid_session.gate_dir(tmp_path, 5)
    unarmed = seams.snapshot()
    channel, answers = _Channel(), []
    mid_session.arm(str(gate))
    try:
        first = threading.Thread(target=lambda: answers.append(sync.send_chunk(channel, None, [], None, 5)))
        first.start()
        deadline = time.monotonic() + 10
        while not (gate / mid_session.HELD).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (gate / mid_session.HELD).exists() and channel.sent == [5]  # the chunk went out, then it held
        time.sleep(0.2)
        assert first.is_alive() and answers == []  # not before the release
        (gate / mid_session.RELEASE).write_text("")
        first.join(10)
        assert answers == [{"ok": True, "chunk": 0}]
        (gate / mid_session.HELD).unlink()
        assert sync.send_chunk(channel, None, [], None, 5) == {"ok": True, "chunk": 1}  # once only
        assert not (gate / mid_session.HELD).exists()
    finally:
        mid_session.disarm()
    assert seams.replaced_since(unarmed) == [] and seams.restore_all() == []


def test_a_refused_chunk_does_not_hold_the_sender(tmp_path: Path) -> None:
    class Refusing:
        def send(self, *args: Any) -> Any:
            raise RuntimeError("refused")

    gate = mid_session.gate_dir(tmp_path, 1)
    mid_session.arm(str(gate))
    try:
        with pytest.raises(RuntimeError, match="refused"):
            sync.send_chunk(Refusing(), None, [], None, 1)
        assert not (gate / mid_session.HELD).exists()
    finally:
        mid_session.disarm()


def test_a_gate_left_by_an_earlier_run_is_cleared(tmp_path: Path) -> None:
    gate = mid_session.gate_dir(tmp_path, 2)
    (gate / mid_session.HELD).write_text("")
    (gate / mid_session.RELEASE).write_text("")
    assert mid_session.gate_dir(tmp_path, 2) == gate and list(gate.iterdir()) == []


def test_put_back_over_a_fault_leaves_the_fault() -> None:
    """Held while a fault replaced the same seam: `disarm` puts back the fault, which `restore_all` undoes."""
    original = sync.send_chunk
    seams.replace("send_chunk", lambda orig: lambda *args: orig(*args))
    faulted = sync.send_chunk
    try:
        mid_session.arm("/nonexistent")
        assert sync.send_chunk is not faulted
        mid_session.disarm()
        assert sync.send_chunk is faulted
    finally:
        assert seams.restore_all() == ["send_chunk"]
    assert sync.send_chunk is original
