"""A SIGTERM or SIGINT whose KeyboardInterrupt Python ignores still ends a run (`harness.interrupts`).

A handler's exception that lands in code whose exceptions Python only prints ("Exception ignored in ...") is
lost: a harness signalled while an at-fork hook ran (logging's `_releaseLock`, after a fork such as Ray's
`Popen(preexec_fn=...)` of its own processes) went on to its end and exited 0. `tests/test_hard_kills.py`
signals whole runs at random moments; these tests put the signal into such a hook on purpose, or drop its
KeyboardInterrupt in the middle of a scenario."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
from harness_cli import sigint_not_ignored

from harness import cli, interrupts
from harness import runner as runner_module
from harness.engines import EngineKey
from harness.record import RunRecord
from harness.scenario import Scenario

LOST_IN_AN_AT_FORK_HOOK = textwrap.dedent(
    """
    import os, signal, subprocess
    from harness import interrupts

    signal.signal(signal.SIGTERM, interrupts.on_signal)
    fired = []

    def hook():  # runs in the parent after a fork, its exceptions printed and dropped
        if not fired:
            fired.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(1000))  # the handler runs between two bytecodes here, inside the hook

    os.register_at_fork(after_in_parent=hook)
    subprocess.run(["true"], check=True, preexec_fn=lambda: None)  # forks with the hooks, as Ray starts its processes
    print("went on", flush=True)
    {check}
    print("ran to its end", flush=True)
    """
)


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_interrupts(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as if it had got no signal yet (`harness.interrupts`), and as it was again after the test."""
    monkeypatch.setattr(interrupts, "_signalled", None)
    monkeypatch.setattr(interrupts, "_last", None)


def _python(code: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    """`python -c code` in a new interpreter from the repository's root; its output captured as text."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)


def _run(check: str) -> subprocess.CompletedProcess[str]:
    return _python(LOST_IN_AN_AT_FORK_HOOK.format(check=check))


def test_a_keyboard_interrupt_lost_in_an_at_fork_hook_is_raised_again() -> None:
    lost = _run("pass")  # without the check: the signal is printed and forgotten
    assert "Exception ignored" in lost.stderr and "KeyboardInterrupt: signal 15" in lost.stderr, lost.stderr
    assert lost.stdout.splitlines() == ["went on", "ran to its end"] and lost.returncode == 0

    checked = _run("interrupts.raise_if_signalled()")
    assert checked.stdout.splitlines() == ["went on"], checked.stdout
    assert "its first KeyboardInterrupt was lost" in checked.stderr, checked.stderr
    assert checked.returncode == -signal.SIGINT  # Python's exit on an uncaught KeyboardInterrupt


class _Run:
    """Stands in for `harness.matrix_run.MatrixRun` in `run_scenarios`: the real one's `close` shuts this
    process's Ray down, which the test session's other tests share."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.ran: list[str] = []
        self.closed = False
        self.records: list[object] = []
        self.out = Path(".")
        RUNS.append(self)

    def run(self, sc: Scenario, *args: object, **kwargs: object) -> None:
        self.ran.append(sc.id)

    def close(self) -> None:
        self.closed = True


RUNS: list[_Run] = []


def test_a_run_signalled_before_a_scenario_does_not_start_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(interrupts, "_signalled", signal.SIGTERM)
    monkeypatch.setattr("harness.matrix_run.MatrixRun", _Run)
    RUNS.clear()
    with pytest.raises(KeyboardInterrupt, match="signal 15"):
        cli.run_scenarios([Scenario(model="qwen3")], tmp_path, "signalled", None, after_sync=None)
    assert [(r.ran, r.closed) for r in RUNS] == [([], True)]  # nothing started, and the run closed


class _SignalAfterSync:
    """The runner's `after_sync` hook: after sync `at` it runs the SIGTERM handler (`interrupts.on_signal`), and
    where `lost`, drops its KeyboardInterrupt as Python drops one raised in an at-fork hook."""

    def __init__(self, at: int, lost: bool) -> None:
        self.at, self.lost = at, lost
        self.calls: list[int] = []

    def __call__(self, record: object, index: int, pids: object) -> None:
        self.calls.append(index)
        if index != self.at:
            return
        try:
            interrupts.on_signal(signal.SIGTERM, None)
        except KeyboardInterrupt:
            if not self.lost:
                raise


@pytest.mark.parametrize("lost", [True, False], ids=["lost", "delivered"])
def test_a_signal_in_a_scenario_ends_it_at_once_and_only_once(
    runner, monkeypatch: pytest.MonkeyPatch, lost: bool
) -> None:
    monkeypatch.setattr(interrupts, "_signalled", None)  # and back to None after the test, whatever happens
    hook = _SignalAfterSync(at=0, lost=lost)
    monkeypatch.setattr(runner, "after_sync", hook)
    sc = Scenario(model="qwen3", syncs=4, logprobs=False, suffix=f"interrupted-{'lost' if lost else 'delivered'}")
    with pytest.raises(KeyboardInterrupt, match="was lost" if lost else r"signal 15$"):
        runner.run_scenario(sc)
    # A lost one is raised again by the wait on sync 1's ranks, not after the scenario ran to its end.
    assert hook.calls == [0]
    # The runner saw it delivered: a wait of a later scenario does not raise it again.
    assert interrupts._signalled is None
    # What the scenario had is on disk, judged: sync 0, the interrupt as the runner's error, every rank's phase.
    rec = RunRecord.load(runner.record_path(sc.id))
    assert [s.index for s in rec.syncs] == [0]
    assert rec.verdict == "CRASH" and [(e.where, e.type) for e in rec.errors] == [("runner", "KeyboardInterrupt")]
    resend = "(4, then one that re-sends unchanged weights)"
    phases = f"after 1 of 5 planned syncs {resend}; last phases: rank0: {rec.progress['rank0']}"
    assert phases in rec.errors[0].message, rec.errors
    assert sorted(rec.progress) == ["rank0"] and rec.progress["rank0"], rec.progress
    monkeypatch.setattr(runner, "after_sync", None)
    rec = runner.run_scenario(Scenario(model="qwen3", syncs=2, logprobs=False))
    assert rec.verdict == "PASS", (rec.verdict, rec.errors)


@pytest.mark.parametrize("step", ["engines_reusable", "wall_split"])  # before the engines are shelved or ended; last
def test_a_signal_in_a_scenarios_cleanup_still_writes_its_record(
    runner, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    import ray

    monkeypatch.setattr(interrupts, "_signalled", None)
    real_step, real_end_engines = getattr(runner_module, step), runner_module.end_engines
    ended: list[list[object]] = []

    def signalled(*args: object, **kwargs: object) -> object:  # a step of the cleanup, once every sync ran
        monkeypatch.setattr(runner_module, step, real_step)
        interrupts.on_signal(signal.SIGINT, None)
        raise AssertionError("unreachable")

    def end_engines(engines: list[object], *args: object) -> None:
        ended.append(list(engines))
        real_end_engines(engines, *args)

    monkeypatch.setattr(runner_module, step, signalled)
    monkeypatch.setattr(runner_module, "end_engines", end_engines)
    sc = Scenario(model="qwen3", syncs=2, logprobs=False, suffix=f"interrupted-in-cleanup-{step}")
    with pytest.raises(KeyboardInterrupt, match=r"signal 2$"):
        runner.run_scenario(sc)
    assert interrupts._signalled is None
    assert sc.world_size not in runner.pools  # the cleanup was cut short: its ranks serve no later scenario
    rec = RunRecord.load(runner.record_path(sc.id))
    assert [s.index for s in rec.syncs] == [0, 1, 2] and rec.verdict == "CRASH"  # the last re-sends unchanged weights
    assert "after 3 of 3 planned syncs" in rec.errors[-1].message, rec.errors
    assert runner.live_engines is None
    if step == "engines_reusable":  # cut short before it shelved or ended its engine: the runner ended it
        assert len(ended) == 1 and len(ended[0]) == 1, ended
        deadline = time.monotonic() + 30
        with pytest.raises(ray.exceptions.RayActorError):  # its actor stops answering within 30 s
            while time.monotonic() < deadline:  # ray.kill is asynchronous: a threaded actor may serve a call sent
                ray.get(ended[0][0].pid.remote(), timeout=30)  # just after it
                time.sleep(0.2)


def test_an_interrupted_scenario_meets_no_expectation_and_leaves_its_group_open(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from harness.checks import expectation_met
    from harness.matrix_run import MatrixRun

    monkeypatch.setattr("harness.env.write_env", lambda *args, **kwargs: {})  # no host calibration
    base = {"model": "qwen3", "syncs": 3, "group": "chunks", "suffix": "chunk-{chunk_bytes}", "expect": "CRASH"}
    first, second = Scenario(**base, chunk_bytes=65536), Scenario(**base, chunk_bytes=1 << 20)
    done = RunRecord(scenario_id=first.id, scenario=first, run_id="t")
    stopped = RunRecord(scenario_id=second.id, scenario=second, run_id="t")
    assert expectation_met(stopped, "CRASH")  # as a fault that expects CRASH would be caught
    stopped.errors.append(interrupts.interrupted_error(KeyboardInterrupt(), stopped, None))
    assert "interrupted (Ctrl-C) after 0 of 4 planned syncs" in stopped.errors[0].message, stopped.errors
    assert not expectation_met(stopped, "CRASH")  # a Ctrl-C catches no fault

    class _Runner:  # a group of members that ran different numbers of syncs must not be compared
        def finish_group(self, members: list[RunRecord]) -> list[RunRecord]:
            raise AssertionError(f"group closed with an interrupted member: {[m.scenario_id for m in members]}")

    run = MatrixRun([first, second], tmp_path, "t")
    run.runner = _Runner()  # type: ignore[assignment]
    monkeypatch.setattr(run, "write_outputs", lambda plots=None: None)
    run._on_record(done)
    run._on_record(stopped)
    assert run.records == [done, stopped] and run.finished_groups == {}


def test_a_keyboard_interrupt_without_text_is_named_by_the_signal_delivered(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ray's waits raise a KeyboardInterrupt of their own when the handler interrupts them: its text is lost
    monkeypatch.setattr(interrupts, "_signalled", signal.SIGTERM)
    sc = Scenario(model="qwen3", syncs=1)
    rec = RunRecord(scenario_id=sc.id, scenario=sc, run_id="t")
    assert (
        "interrupted (signal 15) after 0 of 2 planned syncs"
        in interrupts.interrupted_error(KeyboardInterrupt(), rec, interrupts.delivered()).message
    )
    named_again = interrupts.interrupted_error(KeyboardInterrupt(), rec, interrupts.delivered()).message
    assert "interrupted (Ctrl-C)" in named_again  # named once


def _closing_without_ray(
    monkeypatch: pytest.MonkeyPatch, calls: list[str] | None = None, ray_up_before: bool = False
) -> None:
    """Stand-ins for what `MatrixRun`'s start and close touch outside this process: env.json's host calibration
    and end, this process's Ray (the test session's other tests share it; `ray_up_before`: whether a run made now
    finds it up), its leftovers and its engine servers' temp root (where the session runner's live servers keep
    their temp folders and exit statuses: removing it made every later stop of one of them wait 16 s for a status
    that was never written). With `calls`, the Ray, leftovers and temp-root stand-ins append their step ("ray
    down", "leftovers", "temp root")."""
    note = calls.append if calls is not None else (lambda step: None)
    monkeypatch.setattr("harness.env.write_env", lambda *args, **kwargs: {})
    monkeypatch.setattr("harness.env.finish_env", lambda *args, **kwargs: {})
    monkeypatch.setattr("ray.is_initialized", lambda: ray_up_before)
    monkeypatch.setattr("harness.driver_ray.shutdown_ray", lambda: note("ray down"))
    monkeypatch.setattr("harness.driver_ray.end_leftovers", lambda started: note("leftovers"))
    monkeypatch.setattr("harness.driver_ray.remove_server_temp_root", lambda: note("temp root"))


def test_a_run_closed_by_an_interrupt_writes_its_tables_and_outputs_before_its_plots(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from harness.matrix_run import MatrixRun

    _closing_without_ray(monkeypatch)
    sc = Scenario(model="qwen3", syncs=1)
    outputs: list[int] = []
    run = MatrixRun([sc], tmp_path, "t", after_each=lambda records, out: outputs.append(len(records)))
    run.records.append(RunRecord(scenario_id=sc.id, scenario=sc, run_id="t"))

    def interrupted_import(df: object) -> None:  # an interrupt inside matplotlib's import, as a signal can land
        raise KeyboardInterrupt("signal 15")

    monkeypatch.setattr(run, "write_plots", interrupted_import)
    with pytest.raises(KeyboardInterrupt):
        run.close()
    assert (tmp_path / "t" / "summary.md").exists() and (tmp_path / "t" / "summary.csv").exists()
    assert outputs == [1]  # e.g. faults.md, written by the caller's after_each


def test_a_run_stops_its_fork_servers_once_its_ray_is_down(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The rank fork server waits up to 10 s for its children, which are Ray workers; an interrupt in early
    # setup leaves an idle one that only Ray's shutdown ends, so stopping the fork servers first made such a run
    # wait the whole 10 s before Ray went down.
    calls = _closed_run_steps(monkeypatch, tmp_path, ray_up_before=False)
    assert calls == ["runner (fork servers: False)", "ray down", "fork servers", "leftovers", "temp root"]


def test_a_run_leaves_a_ray_it_did_not_start_and_that_ray_s_server_temp_root(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Two runs in one process (a test session's runner and a run a test closes): the second's close shut the
    # first's Ray down and removed the folder where its live engine servers keep their exit statuses.
    calls = _closed_run_steps(monkeypatch, tmp_path, ray_up_before=True)
    assert calls == ["runner (fork servers: False)", "fork servers", "leftovers"]  # its own processes only


def _closed_run_steps(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ray_up_before: bool) -> list[str]:
    """The steps a `MatrixRun`'s close took (`_closing_without_ray`'s, and its runner's and fork servers')."""
    from harness.matrix_run import MatrixRun

    calls: list[str] = []
    _closing_without_ray(monkeypatch, calls, ray_up_before=ray_up_before)
    run = MatrixRun([Scenario(model="qwen3")], tmp_path, "t")
    run.runner = SimpleNamespace(
        close=lambda fork_servers=True: calls.append(f"runner (fork servers: {fork_servers})"),
        forks=SimpleNamespace(stop=lambda: calls.append("fork servers")),
    )
    run.close()
    return calls


def test_a_signal_while_a_run_closes_is_held_until_it_has_closed(
    fresh_interrupts: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Ctrl-C to the process group while the run ended its engines cut its close short: the trainer pools were
    # never killed, and a colocated sender's shared-memory segment stayed in /dev/shm (a new user's trial, 3 of 3).
    from harness.matrix_run import MatrixRun

    calls: list[str] = []

    def runner_close(fork_servers: bool = True) -> None:
        interrupts.on_signal(signal.SIGINT, None)  # arrives while the engines end
        calls.append("engines and pools")

    _closing_without_ray(monkeypatch, calls)
    sc = Scenario(model="qwen3", syncs=1)
    run = MatrixRun([sc], tmp_path, "t", after_each=lambda records, out: calls.append("after_each"))
    run.runner = SimpleNamespace(close=runner_close, forks=SimpleNamespace(stop=lambda: calls.append("fork servers")))
    run.records.append(RunRecord(scenario_id=sc.id, scenario=sc, run_id="t"))
    monkeypatch.setattr(run, "write_plots", lambda df: calls.append("plots"))
    with pytest.raises(KeyboardInterrupt, match=r"signal 2 \(held until the cleanup ended\)"):
        run.close()
    assert calls == ["engines and pools", "ray down", "fork servers", "leftovers", "temp root", "after_each", "plots"]
    assert (tmp_path / "t" / "summary.md").exists()


MAKES_A_SEGMENT = (
    "from multiprocessing import resource_tracker\n"
    "import time\n"
    "from reference_impl.transport.handles import SharedMemoryBuffer\n"
    "buf = SharedMemoryBuffer(4096)\n"
    "resource_tracker.unregister(buf.shm._name, 'shared_memory')  # as a killed rank's tracker, ended with it\n"
    "print(buf.name, flush=True)\n"
    "time.sleep(600)\n"
)


def test_a_second_signal_while_a_run_closes_cuts_one_step_short_and_every_later_step_runs(
    fresh_interrupts: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A second Ctrl-C to the process group in the run's close (0.3 s after the first) skipped every step after the
    # one it landed in: summary.md kept saying every scenario passed, and the colocated sender's segment, whose
    # rank was killed before its pool's kill unlinked it, stayed in /dev/shm (a new user's trial; then 6 of 12 tries).
    from harness.matrix_run import MatrixRun
    from harness.shm import SHM_DIR

    calls: list[str] = []
    _closing_without_ray(monkeypatch, calls)
    sc = Scenario(model="qwen3", syncs=1)
    run = MatrixRun([sc], tmp_path, "t", after_each=lambda records, out: calls.append("after_each"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "reference_impl/engine/vllm")])}
    sender = subprocess.Popen([sys.executable, "-c", MAKES_A_SEGMENT], stdout=subprocess.PIPE, text=True, env=env)
    assert sender.stdout is not None
    segment = SHM_DIR / sender.stdout.readline().strip()
    try:
        assert segment.name.startswith(f"wsh_chunk_{sender.pid:08x}") and segment.exists()

        def runner_close(fork_servers: bool = True) -> None:
            interrupts.on_signal(signal.SIGINT, None)  # held
            sender.kill()  # the pool's kill ended the rank; its unlink is not reached
            sender.wait()
            calls.append("engines and pools")

        def end_leftovers(started: object) -> None:
            calls.append("leftovers")
            interrupts.on_signal(signal.SIGINT, None)  # the second signal: this step is cut short

        monkeypatch.setattr("harness.driver_ray.end_leftovers", end_leftovers)
        run.runner = SimpleNamespace(
            close=runner_close, forks=SimpleNamespace(stop=lambda: calls.append("fork servers"))
        )
        run.records.append(RunRecord(scenario_id=sc.id, scenario=sc, run_id="t"))
        monkeypatch.setattr(run, "write_plots", lambda df: calls.append("plots"))
        with pytest.raises(KeyboardInterrupt, match=r"^signal 2$"):
            run.close()
        assert calls == [
            "engines and pools",
            "ray down",
            "fork servers",
            "leftovers",
            "temp root",
            "after_each",
            "plots",
        ]
        assert "**Interrupted by SIGINT**" in (tmp_path / "t" / "summary.md").read_text()
        assert not segment.exists()
    finally:
        sender.kill()
        segment.unlink(missing_ok=True)


def test_a_run_interrupted_between_scenarios_lists_those_it_did_not_reach(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from harness.matrix_run import MatrixRun

    monkeypatch.setattr("harness.env.write_env", lambda *args, **kwargs: {})
    first, second = Scenario(model="qwen3", syncs=1), Scenario(model="qwen3", syncs=1, colocate=True)
    run = MatrixRun([first, second], tmp_path, "t")
    run.records.append(RunRecord(scenario_id=first.id, scenario=first, run_id="t"))
    run.write_tables()
    md = (tmp_path / "t" / "summary.md").read_text()
    assert md.split("## Not run", 1)[1].strip().splitlines()[-1] == f"- `{second.id}`"


def test_a_run_interrupted_while_it_calibrates_the_host_still_writes_its_tables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A SIGTERM in a run's first 2.5 s, while MatrixRun measured the host, left an empty run folder: no env.json,
    # no summary (a new user's trial, 3 of 4), and `harness report` answered that it had no summary.csv.
    from harness import env
    from harness.matrix_run import MatrixRun

    def calibrate(calibrate: bool = False, argv: object = None) -> dict[str, object]:
        if calibrate:
            raise KeyboardInterrupt("signal 15")
        return {"started_at": "2026-01-01T00:00:00+00:00"}

    monkeypatch.setattr(env, "collect_env", calibrate)
    planned = [Scenario(model="qwen3", syncs=1)]
    with pytest.raises(KeyboardInterrupt, match="signal 15"):
        MatrixRun(planned, tmp_path, "t")
    assert "started_at" in (tmp_path / "t" / "env.json").read_text()
    md = (tmp_path / "t" / "summary.md").read_text()
    assert "No scenario ran." in md and md.rstrip().endswith(f"- `{planned[0].id}`")


def test_a_run_a_signal_ended_in_its_close_says_so_in_its_summary(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A SIGTERM in the run's start or close interrupts no scenario: summary.md read as a clean run, both rows
    # PASS, while the process exited 143 (a new user's trial, 5 of 5 at the close).
    from harness.matrix_run import MatrixRun

    _closing_without_ray(monkeypatch)
    planned = [Scenario(model="qwen3", syncs=1)]
    monkeypatch.setattr(interrupts, "_last", None)
    MatrixRun(planned, tmp_path, "clean").close()
    assert "Interrupted" not in (tmp_path / "clean" / "summary.md").read_text()
    monkeypatch.setattr(interrupts, "_last", signal.SIGTERM)
    MatrixRun(planned, tmp_path, "ended").close()
    md = (tmp_path / "ended" / "summary.md").read_text()
    assert "**Interrupted by SIGTERM**: the run ended before its planned end." in md.split("|", 1)[0]


def test_a_run_interrupted_before_any_record_still_writes_its_summary(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # An interrupt in the first seconds left no summary.md, and `harness report` then answered that the run's
    # folder had no summary.csv (a new user's trial, 6 of 6).
    from harness.matrix_run import MatrixRun
    from harness.report import load_run

    _closing_without_ray(monkeypatch)
    planned = [Scenario(model="qwen3", syncs=1), Scenario(model="qwen3", syncs=1, colocate=True)]
    MatrixRun(planned, tmp_path, "t").close()
    md = (tmp_path / "t" / "summary.md").read_text()
    assert "No scenario ran." in md and md.rstrip().endswith(f"- `{planned[0].id}`\n- `{planned[1].id}`")
    assert len(load_run(tmp_path / "t").table) == 0  # a report reads it: every baseline scenario is missing


def test_a_second_signal_while_one_is_held_raises_at_once(
    fresh_interrupts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    reached: list[str] = []
    with pytest.raises(KeyboardInterrupt, match=r"^signal 15$"), interrupts.held():
        interrupts.on_signal(signal.SIGINT, None)  # held
        reached.append("after the first")
        interrupts.on_signal(signal.SIGTERM, None)  # a way out of a cleanup that seems stuck
        reached.append("after the second")
    assert reached == ["after the first"] and interrupts.exit_status() == 143
    assert interrupts.delivered() == signal.SIGTERM  # the second signal's KeyboardInterrupt is the one raised
    with interrupts.held():  # nothing held from before
        pass
    with pytest.raises(OSError), interrupts.held():  # a cleanup that fails keeps the signal it held, as one lost
        interrupts.on_signal(signal.SIGTERM, None)
        raise OSError("the cleanup failed")
    with pytest.raises(KeyboardInterrupt, match="was lost"):
        interrupts.raise_if_signalled()


def test_signals_in_a_deferred_block_are_delivered_once_it_has_ended(fresh_interrupts: None) -> None:
    reached: list[str] = []
    with pytest.raises(KeyboardInterrupt, match=r"^signal 2$"), interrupts.deferred():
        interrupts.on_signal(signal.SIGINT, None)
        reached.append("went on")
    assert reached == ["went on"] and interrupts.delivered() == signal.SIGINT
    # in a cleanup under `held`: the first is held for the cleanup's end, the second raises once the block ends
    with pytest.raises(KeyboardInterrupt, match=r"^signal 15$"), interrupts.held():
        with interrupts.deferred():
            interrupts.on_signal(signal.SIGINT, None)
            interrupts.on_signal(signal.SIGTERM, None)
            reached.append("went on under held")
        reached.append("after the block")
    assert reached[1:] == ["went on under held"] and interrupts.exit_status() == 143
    interrupts.delivered()
    with interrupts.deferred():  # nothing kept from before
        pass
    with pytest.raises(OSError), interrupts.deferred():  # a block that fails: its error goes on, the signal is kept
        interrupts.on_signal(signal.SIGTERM, None)
        raise OSError("the step failed")
    with pytest.raises(KeyboardInterrupt, match="was lost"):
        interrupts.raise_if_signalled()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_command_a_signal_ended_exits_as_a_shell_reports_that_signal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], signum: int
) -> None:
    # A batch scheduler or a CI runner's timeout sends SIGTERM and reads 143 as "terminated"; Python's own exit
    # after an uncaught KeyboardInterrupt ends the process by SIGINT, which a shell reports as 130.
    monkeypatch.setattr(interrupts, "install", lambda: None)  # this test process keeps its handlers
    monkeypatch.setattr(interrupts, "_last", None)

    def signalled_command(args: object) -> int:  # the signal lands while the command runs; its cleanup ran
        try:
            interrupts.on_signal(signum, None)
        finally:
            interrupts.delivered()  # as the runner marks it once its scenario's cleanup has ended
        return 0

    monkeypatch.setattr(cli, "cmd_list", signalled_command)
    if signum == signal.SIGTERM:
        assert cli.main(["list", "--matrix", "cpu"]) == 143
        assert "interrupted by SIGTERM" in capsys.readouterr().err
    else:
        with pytest.raises(KeyboardInterrupt, match="signal 2"):
            cli.main(["list", "--matrix", "cpu"])


@ray.remote
class _NeverStarts:
    """Stands in for a spare `harness.placement.EngineActor` whose server never answers: threaded, as that actor
    is, so `restore_priority` answers while `start` still waits."""

    def start(self) -> None:
        time.sleep(600)

    def restore_priority(self) -> None:
        return None

    def stop(self, grace_s: float) -> None:
        return None


def test_a_lost_signal_ends_the_wait_for_a_spare_engines_start_and_the_engine(
    runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The waits for engines and ranks to start are as long as a start may take (minutes for vLLM): a signal
    # lost meanwhile used to wait for the start's end or its timeout, and the taken engine was nobody's to end.
    monkeypatch.setattr(interrupts, "_signalled", signal.SIGTERM)
    monkeypatch.setattr(runner_module, "engine_kind", lambda name: SimpleNamespace(start_timeout_s=5.0))
    key = EngineKey.of(Scenario(model="qwen3-vl-moe", engine_seed=7), reachable=False)
    actor = _NeverStarts.options(max_concurrency=2).remote()
    monkeypatch.setitem(runner.spare_engines, key, (actor, actor.start.remote()))
    sc = Scenario(model="qwen3-vl-moe")
    rec = RunRecord(scenario_id=sc.id, scenario=sc, run_id="t")
    try:
        with pytest.raises(KeyboardInterrupt, match="was lost"):
            runner._take_spare_engine(key, rec)
        assert runner.live_engines == ([actor], key.engine)  # run_scenario's handler ends it
        assert rec.notes == []
    finally:
        runner.live_engines = None
        ray.kill(actor, no_restart=True)


def _ray_init_handler(what: str) -> Callable[[int, object], None]:
    """A SIGTERM handler as ray.init sets them: its first (ray/_private/worker.py `init`: sys.exit(15)), its
    node's once the node processes start (ray/_private/node.py: sys.exit(1)), or either one whose SystemExit
    Python dropped (it ran in an at-fork hook as Ray forked a process): nothing reaches the caller."""

    def handler(signum: int, frame: object) -> None:
        if what == "exit 15":
            sys.exit(signum)
        if what == "exit 1":
            sys.exit(1)

    return handler


@pytest.mark.parametrize("what", ["exit 15", "exit 1", "dropped"])
def test_a_sigterm_that_meets_ray_inits_own_handlers_ends_the_run_as_any_sigterm(
    fresh_interrupts: None, monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    # A run SIGTERMed while ray.init ran exited 15 or 1, or, where Python dropped Ray's SystemExit, went on to
    # its end and exited 0.
    from harness import driver_ray

    previous = signal.signal(signal.SIGTERM, interrupts.on_signal)
    try:
        with pytest.raises(KeyboardInterrupt, match="signal 15"), driver_ray._keeping_sigterm_handler():
            signal.signal(signal.SIGTERM, _ray_init_handler(what))
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)  # the handler runs at the next bytecode; ray.init then goes on
        assert signal.getsignal(signal.SIGTERM) is interrupts.on_signal
        assert interrupts.exit_status() == 143
        with driver_ray._keeping_sigterm_handler():  # a later block without a signal raises nothing
            signal.signal(signal.SIGTERM, _ray_init_handler(what))
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_an_interrupted_command_ends_with_one_line_and_python_s_sigint_exit() -> None:
    # Ctrl-C printed a traceback of some 40 lines through the run's cleanup; the interrupted scenario's record
    # holds where it was. Python still ends the process by SIGINT, as a shell expects of a Ctrl-C'd command.
    code = (
        "import sys\n"
        "from harness import cli, interrupts\n"
        "sys.excepthook = cli.print_interrupt  # as harness/__main__.py sets it\n"
        "interrupts.install()\n"
        "interrupts.on_signal(2, None)\n"
    )
    out = _python(code)
    assert out.returncode == -signal.SIGINT and out.stderr == "interrupted by SIGINT\n", out.stderr
    assert "sys.excepthook = print_interrupt" in (ROOT / "harness" / "__main__.py").read_text()


SIGNALLED_AS_RAY_STOPS_ITS_NODE = (
    "from ray._private.node import Node\n"
    "stop = Node.kill_all_processes\n"
    "def signalled_first(self, *args, **kwargs):\n"
    "    os.kill(os.getpid(), signal.SIGTERM)\n"
    "    time.sleep(0.5)\n"
    "    return stop(self, *args, **kwargs)\n"
    "Node.kill_all_processes = signalled_first\n"
)


@pytest.mark.parametrize("when", ["after ray.shutdown", "while ray.shutdown stops the node processes"])
def test_a_sigterm_around_ray_shutdown_reaches_the_harness_handler(when: str) -> None:
    # The core worker's shutdown leaves SIGTERM at the C level to the default action while Python still names the
    # harness's handler: a SIGTERM late in a run's close killed it at once (-15), before its tables; also in the
    # second in which Ray then stops its node processes (new users' trials: 2 of 2, then 5 of 5).
    during = when.startswith("while")
    code = (
        "import os, signal, time\n"
        "from harness import driver_ray, interrupts\n"
        + (SIGNALLED_AS_RAY_STOPS_ITS_NODE if during else "")
        + "interrupts.install()\n"
        "driver_ray.ensure_ray()\n"
        "try:\n"
        "    driver_ray.shutdown_ray()\n"
        + ("" if during else "    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(5)\n")
        + "except KeyboardInterrupt as e:\n"
        "    print('handled:', e, flush=True)\n"
    )
    out = _python(code)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "handled: signal 15", (out.returncode, out.stderr)


SECOND_CTRL_C_AS_THE_CORE_WORKER_SHUTS_DOWN = textwrap.dedent(
    """
    import os, signal, sys
    from harness import cli, interrupts

    sys.excepthook = cli.print_interrupt  # as harness/__main__.py sets it, before the command imports Ray
    interrupts.install()
    import ray._private.worker as worker  # Ray's own excepthook, which calls the one above after its own work
    from harness import driver_ray

    class SignalledAsItReturns:  # the driver's core worker, whose shutdown a second Ctrl-C meets
        def __init__(self, real):
            self.real = real

        def __getattr__(self, name):
            return getattr(self.real, name)

        def shutdown_driver(self):
            self.real.shutdown_driver()  # most of ray.shutdown's time: a Ctrl-C lands here, raised as it returns
            os.kill(os.getpid(), signal.SIGINT)

    driver_ray.ensure_ray()
    worker.global_worker.core_worker = SignalledAsItReturns(worker.global_worker.core_worker)
    with interrupts.held():  # a run's close
        os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C, held for the close's end
        driver_ray.shutdown_ray()
    """
)


def test_a_second_ctrl_c_as_ray_shuts_the_driver_down_is_raised_once_the_shutdown_has_ended() -> None:
    # Raised in the middle of ray.shutdown, just after it shut the driver's core worker down, the second Ctrl-C of
    # a run's close left the worker's Python object behind; Ray's own excepthook used it, and Ray ended the process
    # at once with status 1 and no message (3 of 18 double Ctrl-Cs in a run's close). Now the Ctrl-C is raised
    # once the shutdown has ended, and the process ends as any interrupted run: one line, then by SIGINT.
    with sigint_not_ignored():  # a Ctrl-C reaches it as from a terminal, also where this pytest ignores SIGINT
        out = _python(SECOND_CTRL_C_AS_THE_CORE_WORKER_SHUTS_DOWN)
    assert out.returncode == -signal.SIGINT, (out.returncode, out.stdout, out.stderr[-3000:])
    assert out.stderr.endswith("interrupted by SIGINT\n"), out.stderr[-3000:]


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_sigterm_as_ray_init_connects_the_driver_is_held_until_ray_init_returns(when: str) -> None:
    # Late in ray.init, once the driver's core worker connected, Ray's C++ failure signal handler took SIGTERM
    # before any Python handler: it printed "SIGTERM received" and the run, closed by then, ended by SIGABRT (134).
    # Just before, Ray's own Python handler raised SystemExit in the middle of the connect, and the run, closed by
    # then, died at its exit by SIGSEGV. Now the signal waits for ray.init to return, and ends the run as any.
    code = (
        "import os, signal, time\n"
        "import ray\n"
        "import ray._private.worker as worker\n"
        "from harness import driver_ray, interrupts\n"
        "connect = worker.connect\n"
        "def signalled(*args, **kwargs):\n"
        + ("    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(0.5)\n" if when == "before" else "")
        + "    out = connect(*args, **kwargs)\n"
        + ("    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(0.5)\n" if when == "after" else "")
        + "    return out\n"
        "worker.connect = signalled\n"
        "interrupts.install()\n"
        "try:\n"
        "    driver_ray.ensure_ray()\n"
        "except KeyboardInterrupt as e:\n"
        "    print('handled, Ray up:', ray.is_initialized(), flush=True)\n"
        "driver_ray.shutdown_ray()\n"
    )
    out = _python(code)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "handled, Ray up: True", (out.returncode, out.stderr)
    assert "SIGTERM received" not in out.stderr, out.stderr[-2000:]


SLOW_IMPORT = textwrap.dedent(
    """
    import sys, time, runpy

    class Slow:  # holds the import of one module once it has said so: the test signals in that moment
        def find_spec(self, name, path=None, target=None):
            if name == {module!r}:
                print("importing", name, flush=True)
                time.sleep({hold_s})
            return None

    sys.meta_path.insert(0, Slow())
    sys.argv = ["harness", "run", "--matrix", {matrix!r}, "--results-dir", {out!r}]
    runpy.run_module("harness", run_name="__main__", alter_sys=True)  # `python -m harness run ...`
    """
)


@pytest.mark.parametrize(("module", "hold_s"), [("harness.interrupts", 2), ("harness.cli", 60)])
def test_a_sigterm_during_the_commands_imports_ends_it_with_143_and_one_line(
    tmp_path: Path, module: str, hold_s: int
) -> None:
    # The harness's handler was installed only once its command's imports (`harness.cli`, then torch, Megatron,
    # Ray: about 2 s here) had run: a SIGTERM in that time ended the process by the signal (-15), with nothing
    # written (a new user's trial, 6 of 6 at 1.0-1.8 s). The signal lands while `module` is imported, whatever
    # the host's speed: `harness.interrupts` (before the harness's handler, the early one keeps the signal) or
    # `harness.cli` (after it). The early handler only records the signal: that hold ends by its time, not by it.
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text("- {model: qwen3, syncs: 1}\n")
    code = SLOW_IMPORT.format(module=module, hold_s=hold_s, matrix=str(matrix), out=str(tmp_path / "out"))
    argv = [sys.executable, "-c", code]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert first == f"importing {module}\n", first
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, (proc.returncode, out[-2000:])
    assert out.rstrip().endswith("interrupted by SIGTERM") and "Traceback" not in out, out[-2000:]
    assert not (tmp_path / "out").exists()  # stopped before it made its results folder
