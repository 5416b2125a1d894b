"""What an engine server's process group leaves in /dev/shm once stopped (`ServerProcess.stop`): the
segments it made while starting are unlinked (vLLM's message queue and TP workers' segments are such;
vLLM's side in `tests/vllm_engine/test_servers.py`), a segment it was handed later is not. A vLLM server
whose launcher died first is reaped (`EngineKind.reap`): its group is killed and only the segments of
vLLM's own name prefixes it held are unlinked.

The server here is a small HTTP server of the test's own: it makes its segment by opening a file under
/dev/shm and mapping it (no resource tracker), and SIGTERM ends it without any cleanup, as it ends a
vLLM engine core or worker that is signalled before its shutdown runs."""

from __future__ import annotations

import contextlib
import mmap
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from process_groups import alive_in_group

from reference_impl import shm_segments
from reference_impl.engine import engine_kind
from reference_impl.engine.process import LOOPBACK, EngineStartError, ServerProcess, free_port
from reference_impl.engine.vllm.adapter import SERVER_MODULE

SHM = Path("/dev/shm")
SIZE = 4096

SERVER = """
import http.server, mmap, os, subprocess, sys, time
own, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
kept = []
def attach(name, create):
    fd = os.open("/dev/shm/" + name, (os.O_CREAT | os.O_EXCL if create else 0) | os.O_RDWR, 0o600)
    if create:
        os.ftruncate(fd, 4096)
    kept.append(mmap.mmap(fd, 4096))
if mode == "child-then-exit":  # a child makes the segment and holds it; the leader exits before serving
    child = "import mmap, os, sys, time; fd = os.open('/dev/shm/' + sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600); " \\
        "os.ftruncate(fd, 4096); m = mmap.mmap(fd, 4096); time.sleep(120)"
    subprocess.Popen([sys.executable, "-c", child, own])
    while not os.path.exists("/dev/shm/" + own):  # the child holds it open from then on
        time.sleep(0.01)
    sys.exit(3)
attach(own, True)
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith("/map/"):
            attach(self.path[len("/map/"):], False)
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


class SegmentServer(ServerProcess):
    """A server that makes /dev/shm segment `own` while it starts (mode "serve"), or whose child makes it
    while the leader exits before it serves (mode "child-then-exit"); GET /map/NAME maps segment NAME."""

    what = "segment server"

    def __init__(self, log_path: Path, own: str, mode: str) -> None:
        super().__init__(str(log_path))
        self.own, self.mode, self.port = own, mode, free_port()

    def launch(self) -> tuple[list[str], dict[str, str], str | None, Callable[[], str | None]]:
        argv = [sys.executable, "-c", SERVER, self.own, str(self.port), self.mode]
        return argv, dict(os.environ), None, lambda: f"http://{LOOPBACK}:{self.port}"


@pytest.fixture
def names() -> Iterator[list[str]]:
    """Two fresh segment names; whatever of them is left is unlinked after the test."""
    made = [f"wsh_test_{kind}_{uuid.uuid4().hex[:12]}" for kind in ("own", "handed")]
    yield made
    for name in made:
        (SHM / name).unlink(missing_ok=True)


def test_a_stopped_server_unlinks_the_segments_it_made_and_not_one_it_was_handed(
    tmp_path: Path, names: list[str]
) -> None:
    own, handed = names
    fd = os.open(SHM / handed, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)  # another program's segment
    os.ftruncate(fd, SIZE)
    handed_map = mmap.mmap(fd, SIZE)
    os.close(fd)
    server = SegmentServer(tmp_path / "server.log", own, "serve")
    url = server.start(timeout_s=60)
    try:
        assert httpx.get(f"{url}/map/{handed}", timeout=10).status_code == 200
        assert server.started_segments == {own}  # what its group held when it first answered /health
    finally:
        server.stop(grace_s=5)
    assert not (SHM / own).exists()  # SIGTERM ended the server before it could unlink it; stop did
    assert (SHM / handed).exists()  # still the other program's
    handed_map.close()


def test_a_server_used_as_a_context_manager_is_stopped_when_its_block_raises(tmp_path: Path, names: list[str]) -> None:
    own = names[0]
    server = SegmentServer(tmp_path / "s.log", own, "serve")
    with pytest.raises(RuntimeError, match="the caller failed"), server:
        server.start(timeout_s=60)
        assert (SHM / own).exists()
        raise RuntimeError("the caller failed")
    assert server.proc is not None and server.ended
    assert alive_in_group(server.proc.pid) == []  # its whole group, in a session of its own, has ended
    assert not (SHM / own).exists()


def test_a_server_whose_start_fails_leaves_no_segment_its_group_made(tmp_path: Path, names: list[str]) -> None:
    own = names[0]
    server = SegmentServer(tmp_path / "server.log", own, "child-then-exit")
    with pytest.raises(EngineStartError, match="segment server exited with 3"):
        server.start(timeout_s=60)
    assert server.proc is not None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and alive_in_group(server.proc.pid):
        time.sleep(0.05)
    assert alive_in_group(server.proc.pid) == []  # the leader's child, re-parented, was in its group and ended too
    assert not (SHM / own).exists()


def test_a_second_stop_neither_signals_nor_reads_the_ended_group(
    tmp_path: Path, names: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed start stops its server, and its caller stops it again: by then the leader's pid may belong to
    another process group (a new engine's), which that second stop must leave alone."""
    server = SegmentServer(tmp_path / "server.log", names[0], "child-then-exit")
    with pytest.raises(EngineStartError):
        server.start(timeout_s=60)
    touched: list[object] = []
    monkeypatch.setattr(shm_segments, "held_by_group", lambda pgid, *a: touched.append(pgid) or set())
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: touched.append((pgid, sig)))
    server.stop()
    assert touched == []


# A leader in a session of its own whose command line names vLLM's API server module (as `reap` checks before
# it signals anything), holding vLLM-named segments (one made by its child) and one that is not vLLM's.
ORPHAN = """
import mmap, os, subprocess, sys, time
def attach(name):
    fd = os.open("/dev/shm/" + name, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    return mmap.mmap(fd, 4096)
queue, dist, other, child_made = sys.argv[1:5]
kept = [attach(queue), attach(dist), attach(other)]
child = "import mmap, os, sys, time; fd = os.open('/dev/shm/' + sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600); " \\
    "os.ftruncate(fd, 4096); m = mmap.mmap(fd, 4096); time.sleep(120)"
subprocess.Popen([sys.executable, "-c", child, child_made])
while not os.path.exists("/dev/shm/" + child_made):
    time.sleep(0.01)
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("looks_like_vllm", [True, False])
def test_reap_unlinks_only_vllms_own_segments_of_a_server_whose_launcher_is_gone(looks_like_vllm: bool) -> None:
    tag = uuid.uuid4().hex[:12]
    queue, dist, other, child_made = (
        f"psm_{tag}",
        f"vllm_dist_{tag}-cpushm_0",
        f"wsh_chunk_{tag}",  # a colocated sender's segment, mapped by the server: not the server's to remove
        f"psm_{tag}_child",
    )
    mine = [queue, dist, other, child_made]
    argv = [sys.executable, "-c", ORPHAN, *mine, SERVER_MODULE if looks_like_vllm else "some.other.server"]
    proc = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        engine_kind("vllm").reap(proc.pid)
        if looks_like_vllm:
            assert alive_in_group(proc.pid) == []
            assert [n for n in mine if (SHM / n).exists()] == [other]
        else:  # not vLLM's server: nothing signalled, nothing unlinked
            assert proc.poll() is None and len(alive_in_group(proc.pid)) == 2
            assert all((SHM / n).exists() for n in mine)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait(timeout=30)
        for name in mine:
            (SHM / name).unlink(missing_ok=True)
