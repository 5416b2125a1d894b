"""No exception raised inside one of the harness's own oracles can produce a CRASH verdict: the oracle's
check says "oracle could not run" and the verdict comes from the checks that did run.

Each case makes one oracle raise in a real scenario (the driver-side ones by patching them in this
process; the trainer-side forward through the `position_ids_wrong_shape` fault of `tests/test_faults.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from harness import session
from harness.oracles import expected
from harness.scenario import Scenario
from reference_impl.forward import hf

pytestmark = pytest.mark.e2e


def _boom(*args: object, **kwargs: object) -> None:
    raise RuntimeError("an oracle's own bug")


# oracle -> (how to make it raise, the check that must carry the note)
ORACLES: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], str]] = {
    "expected state": (lambda mp: mp.setattr(expected.ExpectedState, "checksums", _boom), "parity_expected"),
    "transformers view": (lambda mp: mp.setattr(hf.HfForward, "logprobs", _boom), "logprob_expected"),
    "log-prob comparison": (lambda mp: mp.setattr(session, "logprob_parity", _boom), "logprob_parity"),
}


@pytest.mark.parametrize("oracle", sorted(ORACLES))
def test_an_oracle_that_raises_is_a_note_never_a_crash(runner, monkeypatch: pytest.MonkeyPatch, oracle: str) -> None:
    break_it, check = ORACLES[oracle]
    break_it(monkeypatch)
    # nothing read from an expected state by an earlier scenario of this session: the oracle must run here
    monkeypatch.setattr(expected, "_KEPT", {})
    sc = Scenario(model="qwen3", syncs=1, chunk_bytes=1 << 20, suffix="oracle-" + oracle.replace(" ", "-"))
    rec = runner.run_scenario(sc)
    assert rec.verdict == "PASS", [c for c in rec.checks if c["name"] != check and not c["ok"]]
    note = next(c for c in rec.checks if c["name"] == check)
    assert note["skipped"] and note["reason"].startswith("oracle could not run"), note
    assert "RuntimeError: an oracle's own bug" in note["reason"]
    assert not rec.errors
