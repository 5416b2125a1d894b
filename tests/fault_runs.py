"""The fault scenarios of `tests/test_faults.py`, run once per test session:
`tests/vllm_engine/test_through_the_runner.py` compares real vLLM's verdict for some of them (`VLLM_FAULTS`)
with the embedded engine's, and takes the embedded engine's record of the same scenario from here instead
of running it a second time: from this process, or from the folder the session's xdist workers share
(`fault_records`, in tests/conftest.py), where test_faults.py writes each record it made (in the suite's
order, it runs them long before the vLLM tests ask)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from harness.faults import FAULTS, fault_scenarios
from harness.record import RunRecord
from harness.runner import Runner
from harness.scenario import Scenario

# Trainer-side faults that a non-colocate Qwen3 or Qwen3-VL scenario shows, each run against real vLLM and
# against the embedded engine: both verdicts must be the fault's. They run at temperature 1.0 on both
# engines (vLLM's prompt log-probs do not honour the temperature); the other faults at the embedded
# engine's default (0.7, which exercises the temperature's path). In the order they run: the runner restarts
# one Qwen3 vLLM server for each Qwen3 fault that leaves it in step, so the deadlock, which ends its server,
# comes last (before it, `no_prefix_cache_reset` had to start a new server: about 25 s on a 2-core host).
VLLM_FAULTS = (
    "tied_lm_head_sent",
    "wrong_dtype",
    "drop_last_chunk",
    "gqa_split_wrong",
    "no_prefix_cache_reset",
    "legacy_vision_names",
    "pp_barrier_in_chunk_loop",
)

# Faults only an engine that serves requests between chunks (real vLLM) shows, which the registry runs on vLLM:
# the embedded engine refuses completions during an update session whatever the sender does.
VLLM_ONLY_FAULTS = tuple(f.name for f in FAULTS.values() if f.scenario.get("engine") == "vllm")

_RECORDS: dict[str, RunRecord] = {}


def fault_scenario(name: str, engine: str = "embedded") -> Scenario:
    """The registered scenario of fault `name` on `engine` (temperature 1.0 for `VLLM_FAULTS`)."""
    entry = next(e for e in fault_scenarios() if e["fault"] == name)
    extra = {"logprob_temperature": 1.0} if name in VLLM_FAULTS else {}
    return Scenario(**{**entry, **extra, "engine": engine})


def run_once(runner: Runner, sc: Scenario, shared: Path, reuse: bool = True) -> RunRecord:
    """`runner.run_scenario(sc)`, or, with `reuse`, the record of the same scenario (every field equal) run
    earlier in this test session: by this process, or by another xdist worker of the session, which wrote it
    into the `shared` folder. A record made here is written there too (atomically, `RunRecord.save`)."""
    key = sc.model_dump_json()
    path = shared / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
    if reuse and key not in _RECORDS and path.exists():
        _RECORDS[key] = RunRecord.load(path)
    if not reuse or key not in _RECORDS:
        _RECORDS[key] = runner.run_scenario(sc)
        _RECORDS[key].save(path)
    return _RECORDS[key]
