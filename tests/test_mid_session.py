"""The sender held mid-session (`harness.mid_session`): it stops after its first answered chunk and before its
finish, each once, until the harness releases it, and `disarm` leaves the seams as they were. What the engines
answer then is judged in tests/checks/test_engine_state.py; the e2e runs (tests/test_e2e.py,
tests/test_faults.py, tests/vllm_engine/) ask real engines."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from harness import mid_session
from harness.mid_session import AFTER_FIRST_CHUNK, BEFORE_FINISH, HELD, RELEASE
from reference_impl import seams
from reference_impl.transport import sync


class _Channel:
    def __init__(self) -> None:
        self.sent: list[int] = []

    def send(self, client: Any, tensors: list[Any], info: Any, sync_index: int) -> dict[str, Any]:
        self.sent.append(sync_index)
        return {"ok": True, "chunk": len(self.sent) - 1}


class _Client:
    def __init__(self) -> None:
        self.finished: list[int] = []

    def finish(self, sync_index: int, weight_version: int) -> dict[str, Any]:
        self.finished.append(weight_version)
        return {"weight_version": weight_version}


def _wait_for(path: Path) -> bool:
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return path.exists()


def _held_until_released(gate: Path, point: str, call: Any) -> Any:
    """Run `call()` in a thread; it must hold at `point` until its release is written. Returns its result."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call()))
    thread.start()
    assert _wait_for(gate / f"{point}{HELD}")
    time.sleep(0.2)
    assert thread.is_alive() and out == []  # not before the release
    (gate / f"{point}{RELEASE}").write_text("")
    thread.join(10)
    return out[0]


def test_the_sender_holds_once_after_its_first_answered_chunk_and_once_before_its_finish(tmp_path: Path) -> None:
    gate = mid_session.gate_dir(tmp_path, 5)
    unarmed = seams.snapshot()
    channel, client = _Channel(), _Client()
    mid_session.arm(str(gate))
    try:
        answer = _held_until_released(gate, AFTER_FIRST_CHUNK, lambda: sync.send_chunk(channel, None, [], None, 5))
        assert answer == {"ok": True, "chunk": 0} and channel.sent == [5]  # the chunk went out, then it held
        assert sync.send_chunk(channel, None, [], None, 5) == {"ok": True, "chunk": 1}  # once only
        assert client.finished == []
        answer = _held_until_released(gate, BEFORE_FINISH, lambda: sync.finish_update(client, 5, 5))
        assert answer == {"weight_version": 5} and client.finished == [5]  # sent only once released
        (gate / f"{BEFORE_FINISH}{HELD}").unlink()
        sync.finish_update(client, 6, 6)
        assert not (gate / f"{BEFORE_FINISH}{HELD}").exists()  # once only
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
        assert not (gate / f"{AFTER_FIRST_CHUNK}{HELD}").exists()
    finally:
        mid_session.disarm()


def test_a_gate_left_by_an_earlier_run_is_cleared(tmp_path: Path) -> None:
    gate = mid_session.gate_dir(tmp_path, 2)
    for point in mid_session.POINTS:
        (gate / f"{point}{HELD}").write_text("")
        (gate / f"{point}{RELEASE}").write_text("")
    assert mid_session.gate_dir(tmp_path, 2) == gate and list(gate.iterdir()) == []


def test_disarm_over_a_fault_leaves_the_fault() -> None:
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


def test_a_sender_that_holds_first_before_its_finish_is_asked_there_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every chunk refused (as under fault `wrong_dtype`): the sender never holds after a first answered chunk
    and next holds before its finish. The harness asks there and releases it, instead of waiting for the first
    point while the sender waits at the second until `HOLD_S` runs out (120 s of each such fault run)."""

    class Twin:
        def twin(self) -> Twin:
            return self

        def close(self) -> None:
            pass

    class RanksNotDone:  # the sync calls of the ranks, all still running
        @staticmethod
        def wait(refs: list[Any], num_returns: int, timeout: float) -> tuple[list[Any], list[Any]]:
            time.sleep(timeout)
            return [], refs

    asked: list[str] = []
    monkeypatch.setattr(mid_session, "ray", RanksNotDone)
    monkeypatch.setattr(
        mid_session, "ask_engine", lambda client, caps, prompt, sync, point: asked.append(point) or point
    )
    gate = mid_session.gate_dir(tmp_path, 3)
    sender = threading.Thread(target=mid_session.hold, args=(gate, BEFORE_FINISH))
    sender.start()
    asks = mid_session.ask_while_held(gate, ["rank0"], [Twin()], None, [1, 2], 3, timeout=30)  # type: ignore[arg-type]
    sender.join(10)
    assert not sender.is_alive() and asked == [BEFORE_FINISH] and asks == [[BEFORE_FINISH]]
    assert all((gate / f"{point}{RELEASE}").exists() for point in mid_session.POINTS)
