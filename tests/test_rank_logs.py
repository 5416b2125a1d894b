"""A dead rank's cause, read from its log (`harness.rank_logs`): from the logs real processes write when
gloo aborts them and when they segfault, and from the line Ray's terminate handler writes (as a Ray worker
of this stack wrote it, its native frames included). The whole path, a rank that gloo aborts inside a
scenario, is the fault `handoff_one_element_more` (`tests/test_faults.py`)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from harness.rank_logs import death_cause, demangle, lost_a_peer, ray_exit_detail, read_tail, with_death_cause
from harness.record import ErrorRecord

# The two ranks of a gloo group: rank 1 sends 65 bytes, rank 0 posts a receive of 64.
SHORT_RECEIVE = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=rank, world_size=2)
    if rank == 1:
        dist.send(torch.zeros(65, dtype=torch.uint8), dst=0)
    else:
        dist.recv(torch.empty(64, dtype=torch.uint8), src=1)
    """
)

# The end of a Ray worker's log (`worker-*.err`) when gloo aborted it (shortened): Ray's terminate handler
# writes the exception's text and the native stack on one line, then Python's faulthandler reports the abort
# and lists every Python thread, none current (gloo's own thread aborted), the main thread last.
RAY_WORKER_LOG = (
    "[transformers] `torch_dtype` is deprecated! Use `dtype` instead!\n"
    "[2026-12-07 14:24:45,132 E 10282 10339] logging.cc:118: Unhandled exception: N4gloo13EnforceNotMetE. "
    "what(): [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:456] "
    "op.preamble.length <= op.nbytes. 256 vs 252. Received data size doesn't match expected size. Is there a "
    "distributed collective mismatch in your code? /site-packages/ray/_raylet.so(+0x183910a) [0x7f279ee3910a] "
    "ray::operator<<()\n"
    "/site-packages/torch/lib/libtorch_cpu.so(_ZN4gloo9transport3tcp4Pair4readEv+0x72) [0x7f27dd6fc1c2] "
    "gloo::transport::tcp::Pair::read()\n"
    "Fatal Python error: Aborted\n\n"
    "Thread 0x00007f4c33f6f6c0 (most recent call first):\n"
    '  File "/root/.pyenv/versions/3.12.1/lib/python3.12/concurrent/futures/thread.py", line 89 in _worker\n'
    '  File "/root/.pyenv/versions/3.12.1/lib/python3.12/threading.py", line 1010 in run\n\n'
    "Thread 0x00007f4f36327b80 (most recent call first):\n"
    '  File "/venv/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py", line 2799 in recv\n'
    '  File "/venv/lib/python3.12/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper\n'
    '  File "/work/repo/reference_impl/transport/sync.py", line 113 in collect\n'
    '  File "/work/repo/reference_impl/transport/sync.py", line 458 in sync_loop\n\n'
    "Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)\n"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_gloo_aborted_on_a_short_receive_names_gloo_and_both_sizes(tmp_path: Path) -> None:
    script = tmp_path / "short_receive.py"
    script.write_text(SHORT_RECEIVE)
    port = str(_free_port())
    receiver = subprocess.Popen([sys.executable, str(script), "0", port], stderr=subprocess.PIPE, text=True)
    sender = subprocess.run([sys.executable, str(script), "1", port], capture_output=True, text=True, timeout=120)
    _, log = receiver.communicate(timeout=120)
    assert sender.returncode == 0, sender.stderr
    assert receiver.returncode != 0, log  # aborted by the uncaught C++ exception (SIGABRT)
    cause = death_cause(log)
    assert cause is not None, log
    assert cause.startswith("gloo::EnforceNotMet: [enforce fail at "), cause
    assert "65 vs 64. Received data size doesn't match expected size." in cause, cause


def test_a_segfault_names_the_innermost_python_frame(tmp_path: Path) -> None:
    script = tmp_path / "segfault.py"
    script.write_text("import ctypes\n\ndef read_null():\n    ctypes.string_at(0)\n\nread_null()\n")
    proc = subprocess.run([sys.executable, "-X", "faulthandler", str(script)], capture_output=True, text=True)
    assert proc.returncode != 0
    cause = death_cause(proc.stderr)
    assert cause is not None, proc.stderr
    assert cause.startswith("Fatal Python error: Segmentation fault (Python was in string_at, ctypes/__init__.py:"), (
        cause
    )
    assert cause.endswith(f", called from read_null, {tmp_path.name}/segfault.py:4)"), cause


def test_ray_terminate_handler_line_gives_the_type_and_text_without_the_native_stack() -> None:
    assert death_cause(RAY_WORKER_LOG) == (
        "gloo::EnforceNotMet: [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:456] "
        "op.preamble.length <= op.nbytes. 256 vs 252. Received data size doesn't match expected size. Is there a "
        "distributed collective mismatch in your code? (Python was in recv, distributed/distributed_c10d.py:2799, "
        "called from collect, transport/sync.py:113)"
    )


def test_a_signal_ray_reports_first_names_where_python_was() -> None:
    log = (
        "*** SIGSEGV received at time=1765117485 on cpu 1 ***\n"
        "PC: @ 0x7f0 (unknown) (unknown)\n"
        "Fatal Python error: Segmentation fault\n\n"
        "Current thread 0x00007f3bf0143b80 (most recent call first):\n"
        '  File "/work/repo/reference_impl/export/stream.py", line 120 in iter_raw\n'
        '  File "/work/repo/reference_impl/transport/sync.py", line 318 in _stream_own_chunks\n'
    )
    assert death_cause(log) == "SIGSEGV received (Python was in iter_raw, export/stream.py:120)"


def test_a_log_without_a_fatal_report_gives_no_cause() -> None:
    # What a process the kernel's OOM killer (SIGKILL) ended leaves: its ordinary output.
    assert death_cause("INFO:httpx:HTTP Request: POST http://127.0.0.1:41513/start_weight_update 200 OK\n") is None
    assert death_cause("") is None


def test_demangle_gives_source_names_and_leaves_what_it_cannot_read() -> None:
    assert demangle("N4gloo13EnforceNotMetE") == "gloo::EnforceNotMet"
    assert demangle("St13runtime_error") == "std::runtime_error"
    assert demangle("N3c105ErrorE") == "c10::Error"
    assert demangle("N3c1012NotImplementedIiEE") == "N3c1012NotImplementedIiEE"  # a template: as it is


def _died(message: str = "The actor died unexpectedly before finishing this task.") -> ErrorRecord:
    return ErrorRecord(where="trainer", rank=0, type="ActorDiedError", message=message, traceback="tb")


def test_the_cause_leads_the_rank_error_and_ray_words_follow(tmp_path: Path) -> None:
    log = tmp_path / "worker-1.err"
    log.write_text(RAY_WORKER_LOG)
    err = with_death_cause(_died(), read_tail(str(log)), str(log))
    first, rest = err.message.split("\n", 1)
    assert first.startswith("the rank's process died: gloo::EnforceNotMet: [enforce fail at "), first
    assert rest == "The actor died unexpectedly before finishing this task."
    assert err.traceback.startswith("tb\n--- the end of the rank's log (") and "Pair::read()" in err.traceback
    assert err.type == "ActorDiedError" and err.rank == 0


# Ray's `ActorDiedError` text (Ray 2.x), as the driver gets it for three ways a worker ends.
RAY_ABRUPT = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: TrainerWorker\nThe actor is dead because "
    "its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with "
    "a connection error code 2. End of file. Some common causes include: (1) the process was killed by the OOM killer"
)
RAY_EXIT_3 = (
    "The actor died unexpectedly before finishing this task.\nThe actor is dead because its worker process has died. "
    "Worker exit type: INTENDED_USER_EXIT Worker exit detail: Worker exits with an exit code 3."
)
RAY_SIGTERM = (
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker "
    "exits with an exit code 1. The process receives a SIGTERM."
)


def test_ray_exit_detail_is_kept_only_where_ray_knows_how_the_worker_ended() -> None:
    assert ray_exit_detail(RAY_EXIT_3) == "Worker exits with an exit code 3."
    assert ray_exit_detail(RAY_SIGTERM) == "Worker exits with an exit code 1. The process receives a SIGTERM."
    assert ray_exit_detail(RAY_ABRUPT) is None  # a connection that closed: not how
    assert ray_exit_detail("The actor died unexpectedly before finishing this task.") is None


def test_without_a_cause_an_abrupt_end_says_what_leaves_none_and_where_the_log_is(tmp_path: Path) -> None:
    log = tmp_path / "worker-2.err"
    log.write_text("ordinary output\n")
    err = with_death_cause(_died(RAY_ABRUPT), read_tail(str(log)), str(log), phase="sync 0: exporting (gather)")
    first, rest = err.message.split("\n", 1)
    assert first == (
        "the rank's process died without a fatal report in its log (it ended abruptly: killed by SIGKILL, the "
        "kernel's OOM killer among them, or it called os._exit; its last phase: sync 0: exporting (gather); "
        f"its log: {log})"
    )
    assert rest == RAY_ABRUPT
    unread = with_death_cause(_died(), read_tail(None), None)
    assert "; its log could not be read)\n" in unread.message and unread.traceback == "tb"


def test_without_a_cause_an_exit_ray_saw_is_given_as_ray_says_it(tmp_path: Path) -> None:
    err = with_death_cause(_died(RAY_SIGTERM), "", None, phase="sync 1: handing its tensors to the sender")
    assert err.message.split("\n", 1)[0] == (
        "the rank's process ended without a fatal report in its log (Ray: Worker exits with an exit code 1. The "
        "process receives a SIGTERM.; its last phase: sync 1: handing its tensors to the sender; its log could not "
        "be read)"
    )


def test_the_last_phase_follows_a_cause() -> None:
    err = with_death_cause(_died(), RAY_WORKER_LOG, None, phase="sync 0: collecting chunk 0 of 2")
    assert err.message.split("\n", 1)[0].endswith(
        "transport/sync.py:113); its last phase: sync 0: collecting chunk 0 of 2"
    )


def test_a_gloo_abort_names_the_thread_in_the_collective_not_the_main_thread_waiting_on_it() -> None:
    # A collective run from a worker thread while the main thread joins it; gloo's own thread aborts.
    log = (
        "Unhandled exception: N4gloo13EnforceNotMetE. what(): [enforce fail at pair.cc:456] 32768 vs 16384.\n"
        "Fatal Python error: Aborted\n\n"
        "Thread 0x00007f4c33f6f6c0 (most recent call first):\n"
        '  File "/venv/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py", line 4100 in '
        "all_gather_single\n"
        '  File "/work/repo/reference_impl/trainer/params.py", line 163 in <lambda>\n\n'
        "Thread 0x00007f4f36327b80 (most recent call first):\n"
        '  File "/root/.pyenv/versions/3.12.1/lib/python3.12/threading.py", line 1167 in _wait_for_tstate_lock\n'
        '  File "/work/repo/reference_impl/trainer/params.py", line 164 in _gather_stacked\n'
    )
    cause = death_cause(log)
    assert cause is not None
    assert cause.endswith(
        "(Python was in all_gather_single, distributed/distributed_c10d.py:4100, called from <lambda>, "
        "trainer/params.py:163)"
    ), cause


def test_read_tail_reads_only_the_end(tmp_path: Path) -> None:
    log = tmp_path / "big.err"
    log.write_bytes(b"x" * 100_000 + b"the end\n")
    assert read_tail(str(log), nbytes=8) == "the end\n"
    assert read_tail(str(tmp_path / "missing.err")) == ""


def test_a_peers_connection_reset_is_a_follow_on_error_and_a_death_is_not() -> None:
    reset = (
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:53130: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
    )
    closed = "[.../tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:38087. This is typically caused by ..."
    assert lost_a_peer(ErrorRecord(where="trainer", rank=0, type="RuntimeError", message=reset))
    assert lost_a_peer(ErrorRecord(where="trainer", rank=0, type="RuntimeError", message=closed))
    assert not lost_a_peer(ErrorRecord(where="trainer", rank=0, type="KeyError", message="'model.norm.weight'"))
    assert not lost_a_peer(_died("the rank's process died: gloo::EnforceNotMet: ... Connection reset by peer"))
