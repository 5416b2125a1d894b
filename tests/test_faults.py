"""Every registered fault, injected into a real scenario, produces the verdict it exists for; the
watchdog turns a hang into DEADLOCK with a stack file per process; no process outlives a run, also an
interrupted one."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Set as AbstractSet
from pathlib import Path

import psutil
import pytest
import ray
from fault_runs import VLLM_ONLY_FAULTS, fault_scenario, run_once
from harness_cli import harness_run, sigint_not_ignored

from harness import shm
from harness.checks import expectation_met
from harness.faults import FAULTS
from harness.placement import order_for_reuse
from harness.record import RunRecord
from harness.scenario import Scenario

pytestmark = pytest.mark.e2e

# every fault on the embedded engine but those only real vLLM shows (tests/vllm_engine/test_through_the_runner.py)
SCENARIOS = {name: fault_scenario(name) for name in FAULTS if name not in VLLM_ONLY_FAULTS}
# What a fault leaves the next scenario, as the runner's notes in its record say: these end its engine process
# (the engine dies, or the scenario ends out of step), these its trainer ranks too (a rank raised, hung, or a
# segment it made is still held). They run last in their world-size group, so the faults before them reuse the
# ranks and engines the previous one left, each a process start saved (about 10 s on a 2-core host).
ENDS_ENGINE = {"engine_dies_after_rejected_chunk", "engine_dies_in_clean_sync"}
ENDS_RANKS = {
    "shm_segment_per_sync",
    "planner_key_error",
    "ep_local_expert_ids",
    "duplicate_rank_offsets",
    "second_init_from_pp_stage",
    "pp_barrier_in_chunk_loop",
    "handoff_one_element_more",
    "stage_export_segfaults",
    "bridge_export_segfaults",
}


def _run_order() -> list[str]:
    """Fault names grouped by trainer world size, as `python -m harness` orders a run (`order_for_reuse`);
    within a group, those that leave every process fit first, by engine placement (so a shelved engine of
    the same placement serves the next one), then `ENDS_ENGINE`, then `ENDS_RANKS`."""
    grouped = [sc.fault for sc in order_for_reuse([SCENARIOS[name] for name in sorted(SCENARIOS)])]
    group: dict[int, int] = {}  # world size -> its group's place in the run
    for name in grouped:
        group.setdefault(SCENARIOS[name].world_size, len(group))

    def key(name: str) -> tuple[int, int, bool, int, int]:
        sc = SCENARIOS[name]
        ends = 2 if name in ENDS_RANKS else 1 if name in ENDS_ENGINE else 0
        return group[sc.world_size], ends, not sc.colocate, sc.engine_tp, sc.engines

    return sorted(grouped, key=key)


ORDER = _run_order()


# Python multiprocessing's named semaphores (spawn and forkserver contexts): no scenario left one in quiet
# runs, and any Python program on the host may make one. One that its maker's death left unheld read as this
# test's scenario's leftover while harness runs outside this test session shared the host (a 32-byte
# `sem.mp-0a1gicq8`, 20 s old, after `no_prefix_cache_reset`). The scenario's own segments are judged by the
# resources check and by `shm.present` above, whatever their names.
FOREIGN_PREFIXES = ("sem.mp-",)


def _shm_names() -> set[str]:
    """The names in /dev/shm now, less Python multiprocessing's semaphores (`FOREIGN_PREFIXES`)."""
    return {e.name for e in os.scandir(shm.SHM_DIR) if not e.name.startswith(FOREIGN_PREFIXES)}


def _worker_of(proc: psutil.Process, known: dict[int, str | None]) -> str | None:
    """The pytest-xdist worker whose test started `proc`: the first `PYTEST_XDIST_WORKER` in the environment of it
    or of its nearest ancestor that has one (a process that renames itself, as vLLM's `VLLM::EngineCore` and Ray's
    workers do with setproctitle, overwrites the memory `/proc/<pid>/environ` reads); None for none. `known`:
    answers so far, by pid."""
    chain = []
    for p in [proc, *proc.parents()]:
        if p.pid in known:
            worker = known[p.pid]
            break
        chain.append(p.pid)
        with contextlib.suppress(psutil.Error):
            if worker := p.environ().get("PYTEST_XDIST_WORKER"):
                break
    else:
        worker = None
    known.update(dict.fromkeys(chain, worker))
    return worker


def _is_descendant(proc: psutil.Process) -> bool:
    """Whether `proc` is this test process or was started from it (its Ray, fork servers, engines, ranks)."""
    me = os.getpid()
    return proc.pid == me or any(p.pid == me for p in proc.parents())


def _held_by_other_workers(among: set[str] | None = None) -> set[str]:
    """Names in /dev/shm (of `among`, when given) that processes of another run map or hold open (read with
    psutil): another pytest-xdist worker's (each process's worker by `_worker_of`), or, without a worker, a
    process this test did not start (a harness run beside the suite on the same host). A process of this
    worker's that outlived its parent still carries this worker's name, so a leak of ours is never theirs.
    Empty without xdist."""
    ours = os.environ.get("PYTEST_XDIST_WORKER")
    names: set[str] = set()
    if ours is None or among == set():
        return names
    known: dict[int, str | None] = {}
    for proc in psutil.process_iter():
        try:
            worker = _worker_of(proc, known)
            if worker == ours or (worker is None and _is_descendant(proc)):
                continue
            paths = [m.path for m in proc.memory_maps()] + [f.path for f in proc.open_files()]
        except psutil.Error:
            continue
        names |= {Path(p).name for p in paths if p.startswith(f"{shm.SHM_DIR}/")}
    return names if among is None else names & among


class _OtherWorkersSegments:
    """While a scenario runs: every segment that appears in /dev/shm and is seen held by another xdist worker's
    processes, looked at every 0.5 s (processes are read only when a new name appears). Such a segment is that
    worker's (names are random), also once its holders are gone and before its owner unlinks it: a server
    killed by a signal leaves its segments unheld until its launcher's stop removes them."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        seen = _shm_names()
        while not self._stop.wait(0.5):
            now = _shm_names()
            self.names |= _held_by_other_workers(now - seen)
            seen = now

    def __enter__(self) -> _OtherWorkersSegments:
        if os.environ.get("PYTEST_XDIST_WORKER") is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)


def _new_shm_names(before: set[str], theirs: AbstractSet[str] = frozenset(), settle_s: float = 15.0) -> set[str]:
    """Names in /dev/shm that were not there `before`, less `theirs` and those another xdist worker's processes
    hold, looked at every second until none is left or `settle_s` passed: the other worker's scenarios make and
    remove their own segments meanwhile (one made and not mapped yet, unmapped and not unlinked yet, or left by a
    process it killed until its scenario's end removes it, which takes seconds), while a segment this test's
    scenario left stays."""
    deadline = time.monotonic() + settle_s
    new = _shm_names() - before - theirs
    while new:
        new &= _shm_names()
        new -= _held_by_other_workers(new)
        if not new or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    return new


def _described(names: set[str]) -> list[str]:
    """Each segment's name, size and age, for a failure message."""
    out = []
    for name in sorted(names):
        try:
            st = os.stat(f"{shm.SHM_DIR}/{name}")
            out.append(f"{name} ({st.st_size} bytes, changed {time.time() - st.st_ctime:.0f} s ago)")
        except OSError:
            out.append(f"{name} (gone)")
    return out


@pytest.mark.parametrize("name", ORDER)
def test_fault_is_caught_with_its_verdict(runner, fault_records: Path, name: str) -> None:
    sc = SCENARIOS[name]
    before = _shm_names()
    t0 = time.monotonic()
    with _OtherWorkersSegments() as theirs:
        rec = run_once(runner, sc, fault_records, reuse=False)  # its own run: the checks below watch it
    elapsed = time.monotonic() - t0
    assert rec.verdict == FAULTS[name].expect, [c for c in rec.checks if not c["ok"]]
    assert expectation_met(rec, rec.verdict), (sc.expect_note, rec.checks)  # and the note it expects, if any
    injected = (f"fault injected: {name}", f"fault armed for sync {sc.fault_sync} only: {name}")
    assert any(n.startswith(injected) for n in rec.notes) or FAULTS[name].trainer is None
    _assert_the_fault_is_named(name, rec)
    if sc.fault_sync is not None:  # fail once, then recover: the clean sync restored the expected state
        results = {c["name"]: c for c in rec.checks}
        assert rec.recovery is not None and rec.recovery.clean_sync_finished, rec.recovery
        assert results["recovery"]["ok"], results["recovery"]
        clean = rec.syncs[-1]  # the recovery's clean sync, judged against the expected state (checkpoint + steps)
        assert clean.finished and clean.expected_checksums, clean
        assert {k: clean.engine_checksums.get(k) for k in clean.expected_checksums} == clean.expected_checksums
        # parity_expected may fail, but only on the sync the fault was armed for
        assert results["parity_expected"]["ok"] or f"sync {sc.fault_sync}:" in results["parity_expected"]["message"]
    assert shm.present(shm.held_in(rec.resources)) == {}  # nothing of it left in /dev/shm
    # nor anything it made that no resource sample saw (a segment replaced before sync 0's sample)
    new = _new_shm_names(before, theirs.names)
    assert not new, _described(new)
    if FAULTS[name].expect == "DEADLOCK":
        # Ended within its deadline (+ setup) + 30 s, with one stack file per rank and the engine.
        assert elapsed < sc.deadline_s + 30 + 60
        labels = sorted(Path(p).stem for p in rec.stacks)
        engines = ["engine"] + [f"engine{i}" for i in range(1, sc.engines)]
        assert labels == engines + [f"rank{r}" for r in range(sc.world_size)]
        pids = []
        for p in rec.stacks:
            text = Path(p).read_text()
            assert "Thread" in text, text[:500]  # py-spy read the process
            pids.append(int(re.search(r"pid (\d+)", text).group(1)))
        time.sleep(2)
        assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def test_ranks_serve_the_next_scenario_only_once_the_fault_is_undone(runner, monkeypatch) -> None:
    """After a trainer fault that ran through (`gqa_split_wrong`: every sync answered 200, PARITY_FAIL) the
    runner undoes it and the next scenario runs in the same rank processes, and passes. With an undo that
    undoes nothing, the ranks still run the fault's `convert`: the runner ends them, says why, and the next
    scenario runs in new ranks, and passes."""
    base = {"model": "qwen3", "syncs": 1, "chunk_bytes": 65536, "logprobs": False}
    faulted = Scenario(**base, fault="gqa_split_wrong", expect="PARITY_FAIL", suffix="reuse-faulted")
    after = Scenario(**base, suffix="reuse-after")

    rec = runner.run_scenario(faulted)
    ranks = runner.pools[1].pids
    assert rec.verdict == "PARITY_FAIL" and any(n.startswith("trainer ranks reused after the fault") for n in rec.notes)
    rec = runner.run_scenario(after)
    assert rec.verdict == "PASS", [c for c in rec.checks if not c["ok"]]
    assert runner.pools[1].pids == ranks

    monkeypatch.setattr("harness.runner.RESTORE_SEAMS", "gc:collect")  # an undo that undoes nothing
    rec = runner.run_scenario(faulted)
    assert rec.verdict == "PARITY_FAIL"
    assert "trainer ranks not reused after the fault (seams still replaced: convert)" in rec.notes, rec.notes
    assert 1 not in runner.pools  # ended
    rec = runner.run_scenario(after)
    assert rec.verdict == "PASS", [c for c in rec.checks if not c["ok"]]
    assert not set(runner.pools[1].pids) & set(ranks)


def test_an_engine_fault_that_ran_through_leaves_its_engine_process_to_the_next_scenario(runner) -> None:
    """After `weight_version_not_committed` (an engine hook; every sync answered 200, PARITY_FAIL) the next
    scenario restarts the same engine process, which undoes the hook and says so in the new scenario's log,
    and passes: its weight version commits again."""
    base = {"model": "qwen3", "syncs": 1, "chunk_bytes": 65536, "logprobs": False}
    faulted = Scenario(**base, fault="weight_version_not_committed", expect="PARITY_FAIL", suffix="engine-faulted")
    after = Scenario(**base, suffix="engine-after")

    rec = runner.run_scenario(faulted)
    assert rec.verdict == "PARITY_FAIL"
    engine_pid = rec.resources[0].processes["engine"].pid
    rec = runner.run_scenario(after)
    assert rec.verdict == "PASS", [c for c in rec.checks if not c["ok"]]
    assert f"engine process reused: restarted in place as a fresh engine (pid {engine_pid};" in " ".join(rec.notes)
    hook = FAULTS["weight_version_not_committed"].hook
    assert f"fault hook {hook} undone" in runner.engine_log(after.id, 0).read_text()
    assert rec.syncs[-1].engine_weight_version == str(after.syncs)


def test_a_sync_the_engine_refused_leaves_ranks_and_engine_to_the_next_scenario_after_a_clean_recovery(runner) -> None:
    """After `tied_lm_head_sent` (the engine refuses a chunk naming lm_head.weight: NAME_ERROR) the harness's
    recovery sync, with the fault undone, is clean: every rank and the engine took part in a whole sync after
    the refused one. The next scenario then runs in the same rank processes and restarts the same engine
    process, and passes."""
    base = {"model": "qwen3", "syncs": 1, "chunk_bytes": 65536, "logprobs": False}
    faulted = Scenario(**base, fault="tied_lm_head_sent", expect="NAME_ERROR", suffix="refused-faulted")
    after = Scenario(**base, suffix="refused-after")

    rec = runner.run_scenario(faulted)
    assert rec.verdict == "NAME_ERROR" and rec.recovery is not None and rec.recovery.clean_sync_finished
    assert any(n.startswith("trainer ranks reused after the fault") for n in rec.notes), rec.notes
    ranks, engine_pid = runner.pools[1].pids, rec.resources[0].processes["engine"].pid
    rec = runner.run_scenario(after)
    assert rec.verdict == "PASS", [c for c in rec.checks if not c["ok"]]
    assert runner.pools[1].pids == ranks
    assert f"engine process reused: restarted in place as a fresh engine (pid {engine_pid};" in " ".join(rec.notes)


def test_the_scenario_after_one_whose_engine_died_takes_the_spare_ranks_and_engine(runner) -> None:
    """After `engine_dies_after_rejected_chunk` (the engine exits: CRASH; its ranks are ended too) the next
    scenario runs in the spare pool's rank processes and the spare engine's process (`Runner.spare_pools`,
    `Runner.spare_engine`), restarted as a fresh engine of its own seed, and passes on its own oracles, the
    engine's starting weights included (`engine_fresh`); new spares are started for the scenario after it."""
    base = {"model": "qwen3", "syncs": 1, "chunk_bytes": 65536, "logprobs": False}
    faulted = Scenario(**base, fault="engine_dies_after_rejected_chunk", expect="CRASH", suffix="spare-faulted")
    after = Scenario(**base, suffix="spare-after", engine_seed=777)

    runner.run_scenario(Scenario(**base, suffix="spare-before"))  # a spare engine exists after a scenario like it
    rec = runner.run_scenario(faulted)
    assert rec.verdict == "CRASH"
    spare_ranks, spare_engine = runner.spares[1].pids, _spare_engine_pid(runner)
    rec = runner.run_scenario(after)
    assert rec.verdict == "PASS", [c for c in rec.checks if not c["ok"]]
    taken = f"spare engine process taken: restarted in place as a fresh engine (pid {spare_engine};"
    assert taken in " ".join(rec.notes), rec.notes
    assert runner.pools[1].pids == spare_ranks
    fresh = next(c for c in rec.checks if c["name"] == "engine_fresh")
    assert fresh["ok"] and not fresh["skipped"], fresh
    assert runner.spares[1].pids != spare_ranks and _spare_engine_pid(runner) != spare_engine


def _spare_engine_pid(runner) -> int:
    """The server pid of the runner's one spare engine, once it has started."""
    ((actor, start),) = runner.spare_engines.values()
    ray.get(start, timeout=180)
    return ray.get(actor.pid.remote(), timeout=30)


def _our_processes(marker: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("WSH_RUN_MARKER") == marker and proc.pid != os.getpid():
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


# What the deciding check's message must say for faults whose verdict class alone would not show that the
# harness found the right thing.
MESSAGE_SAYS = {
    "stale_cache_in_sync_loop": "sync 1: ",
    "step_skips_one_parameter": "model.norm.weight",
    "transposed_fused_experts": "the last two dims are swapped",
    "planner_key_error": "raised KeyError",
    "ep_local_expert_ids": "model.layers.0.mlp.experts.0.gate_proj.weight is named by ranks 0 and 1",
    "second_init_from_pp_stage": "accepted 2 /init_weight_transfer_engine calls",
    # the cause from the dead sender's own log, not Ray's "The actor died unexpectedly"
    "handoff_one_element_more": "raised ActorDiedError: the rank's process died: gloo::EnforceNotMet: [enforce fail at",
    # the rank that died and why, not the sender's "Connection reset by peer" that followed
    "stage_export_segfaults": "rank 1 (trainer) raised ActorDiedError: the rank's process died: SIGSEGV received "
    "(Python was in string_at, ctypes/__init__.py:",
    # a rank that died while an oracle ran in it is the trainer's crash, not "oracle could not run"
    "bridge_export_segfaults": "rank 1 (trainer) raised ActorDiedError: the rank's process died: SIGSEGV received "
    "(Python was in string_at, ctypes/__init__.py:",
    "bridge_built_from_config": "engine cannot place name 'lm_head.weight'",
    "drop_last_chunk": "/update_weights calls with 200",
    "chunk_index_not_reset": "calls answered 200 carry chunk indexes [",
    "plan_skips_an_index": "the sender's record has chunk indexes [0, 1, 2, ..., 19, 21], not 0 to 20 once each",
    "plan_overfills_a_chunk": "over the scenario's chunk_bytes 65536 (only a single tensor larger than a chunk",
    # gate, up, o_proj and down_proj of 3 of the 4 layers (q/k/v are copies the split makes; the last layer keeps)
    "gather_buffers_keyed_by_size": "12 of 46 tensors differ",
    "engine_dies_after_rejected_chunk": "the engine died after the failed sync",
    "engine_dies_in_clean_sync": "the engine died after the failed sync 2",
    "no_prefix_cache_reset": "so a cache (prefix or encoder) or a copy of the weights the generation",
    "encoder_cache_survives_update": "log-prob max |diff|",
    "weight_version_not_committed": "the engine reports weight version '0' after finishing version '1'",
    "completions_tagged_with_first_version": "version '1' are tagged weight version '0' (it reports '1')",
    "version_committed_at_start": "sync 2: while its update session was open (its first chunk answered) the engine "
    "reported weight version '2', not '1'",
    "completions_served_during_session": "sync 2: the engine served a completion while the update session was open",
    "duplicate_rank_offsets": "connect: /init_weight_transfer_engine in flight",
    "tp_row_split_as_column": "TP rank 0: 'model.layers.0.",
    "engine_starts_from_checkpoint": "before sync 0 the engine already held the checkpoint's bytes in 46 of 46",
    "engine_starts_from_other_weights": "held other weights than a fresh engine of seed 4321 in 46 of 46 tensors",
}


# Checks a fault passes by design: what they compare agrees under it (so only the oracles that share no code
# with the export can fail it).
STILL_PASSES = {
    # the weights, names and counts are all right: only the indexes on the wire are not the record's
    "chunk_index_not_reset": ("parity_sent", "parity_expected", "coverage", "http_status", "names"),
    # the plan's tensors all arrive: only its indexes, or one bucket's size, are not what the plan promises
    "plan_skips_an_index": ("parity_sent", "parity_expected", "coverage", "http_status", "names"),
    "plan_overfills_a_chunk": ("parity_sent", "parity_expected", "coverage", "http_status", "names"),
    # the weights and /weight_info are right: only the tag on what the engine serves is not
    "completions_tagged_with_first_version": ("parity_sent", "parity_expected", "logprob_parity", "engine_caches"),
    "gather_buffers_keyed_by_size": ("parity_sent", "parity_cross_mode"),
    # every finished sync is right: only what the engine answers while a session is open is not
    "version_committed_at_start": ("parity_sent", "parity_expected", "logprob_parity", "completions_in_session"),
    "completions_served_during_session": ("parity_sent", "parity_expected", "logprob_parity", "weight_version"),
    # every sync then looks right: only the engine's weights before sync 0 show that sync 0 proved nothing
    "engine_starts_from_checkpoint": ("parity_sync0", "parity_expected", "coverage", "logprob_parity"),
    "engine_starts_from_other_weights": ("parity_sync0", "parity_expected", "coverage", "logprob_parity"),
}


def _assert_the_fault_is_named(name: str, rec: RunRecord) -> None:
    results = {c["name"]: c for c in rec.checks}
    assert all(results[check]["ok"] for check in STILL_PASSES.get(name, ())), rec.checks
    if name not in MESSAGE_SAYS:
        return
    deciding = next(c for c in rec.checks if not c["ok"] and not c["skipped"] and c["verdict_on_fail"] == rec.verdict)
    assert MESSAGE_SAYS[name] in deciding["message"], deciding


def test_interrupted_run_leaves_no_process(tmp_path: Path) -> None:
    marker = f"interrupt-{os.getpid()}"
    env = {**os.environ, "WSH_RUN_MARKER": marker}
    with sigint_not_ignored():
        proc = subprocess.Popen(
            harness_run("cpu", tmp_path, "--filter", "qwen3/tp2-pp2/noncolocate/raw", "--run-id", "interrupted"),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    # Wait until the engine server of the scenario is up (its log exists), i.e. every kind of process runs.
    logs = tmp_path / "interrupted" / "logs"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (logs.exists() and any(logs.iterdir())):
        time.sleep(0.5)
    assert logs.exists(), proc.communicate(timeout=60)[0][-3000:]
    time.sleep(3)
    assert len(_our_processes(marker)) > 2  # driver, Ray, trainer ranks, engine
    assert proc.poll() is None  # still running: the interrupt, not the run's end, must end it
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == -signal.SIGINT, out[-3000:]  # ended by the KeyboardInterrupt it raised
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _our_processes(marker):
        time.sleep(1)
    left = [(p, " ".join(psutil.Process(p).cmdline())[:120]) for p in _our_processes(marker) if psutil.pid_exists(p)]
    assert left == []
