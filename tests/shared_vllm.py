"""vLLM servers shared by the test modules that start their own (`shared_vllm` in `tests/conftest.py`).

A vLLM start costs 15-20 s on a 2-core host; a restart in place (`VllmEngineProcess.restart`,
`wsh_vllm_plugin/restart.py`) makes a running server a fresh engine of another checkpoint of the same model
(new dummy weights of the given seed, no transfer group, empty caches, its output in a new log) in well under
a second. A module takes a server (`take`: an idle one restarted, else a new start) and gives it back at its
end (`give_back`); a server the restart refuses (an update session a test left open, requests still running)
is stopped and a new one started. Tokenless, TP 1, float32: the servers the vLLM test modules start."""

from __future__ import annotations

import threading
from collections import defaultdict
from pathlib import Path

from reference_impl.engine import engine_kind
from reference_impl.engine.process import EngineStartError
from reference_impl.engine.vllm.launcher import VllmEngineProcess

START_TIMEOUT_S = 600.0
MAX_IDLE = 1  # per model: an idle server holds about 1.5 GB (its KV cache space is 1 GiB)


class SharedVllm:
    """Idle vLLM servers of this test session, by the model's checkpoint config (see the module doc)."""

    def __init__(self) -> None:
        self.idle: dict[str, list[VllmEngineProcess]] = defaultdict(list)
        self.lock = threading.Lock()
        self.starts = self.restarts = 0

    def take(self, checkpoint: Path, seed: int, log_path: Path) -> VllmEngineProcess:
        """A running server that is a fresh engine of `checkpoint` (dummy weights of `seed`, output to
        `log_path`): an idle one of the same model restarted in place, else a new start (as the runner starts
        one: `engine_kind("vllm").server`). Thread-safe (a module may take several at once).

        Raises:
            EngineStartError: a new server did not start (its log tail in the message).
        """
        key = (checkpoint / "config.json").read_text()
        while True:
            with self.lock:
                proc = self.idle[key].pop() if self.idle[key] else None
            if proc is None:
                break
            try:
                proc.restart(str(checkpoint), seed, str(log_path))
            except EngineStartError:
                proc.stop()
                continue
            with self.lock:
                self.restarts += 1
            return proc
        proc = engine_kind("vllm").server(str(checkpoint), seed, str(log_path), "float32")
        assert isinstance(proc, VllmEngineProcess)
        try:
            proc.start(START_TIMEOUT_S)
        except BaseException:
            proc.stop()
            raise
        with self.lock:
            self.starts += 1
        return proc

    def give_back(self, proc: VllmEngineProcess) -> None:
        """Keep `proc` for a later module if it still runs and `MAX_IDLE` servers of its model are not idle
        already, else stop it (its group and temp folder)."""
        key = (Path(proc.checkpoint) / "config.json").read_text()
        with self.lock:
            keep = proc.proc is not None and proc.proc.poll() is None and proc.restartable
            keep = keep and len(self.idle[key]) < MAX_IDLE
            if keep:
                self.idle[key].append(proc)
        if not keep:
            proc.stop()

    def close(self) -> None:
        """Stop every idle server."""
        with self.lock:
            procs = [p for ps in self.idle.values() for p in ps]
            self.idle.clear()
        for proc in procs:
            proc.stop()
