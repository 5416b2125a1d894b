"""Beyond one node: a Ray cluster of two nodes on this host (a head and a second raylet, each with its own
custom resource), the trainer on one and two engine replicas on the other, joined through `--ray-address`.

The cluster is this test's own: its own GCS port and temp folder, started with `ray start --block` and
stopped by the pids of those two commands (each ends its node's processes when terminated; whatever is
left of their process groups is killed by group id). The second node gets an address of its own
(127.0.0.2), so the engines' URLs, the transfer group's master address and the trainer's node differ
visibly: the master address must be the trainer node's address, the engines must bind to theirs, and every
engine route must have asked for the run's bearer token.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest
from harness_cli import harness_run

from harness.record import RunRecord
from reference_impl.engine.process import free_port

pytestmark = pytest.mark.e2e

ENGINE_NODE_IP = "127.0.0.2"  # loopback, but not 127.0.0.1: an address of the second node's own
RAY = [sys.executable, "-m", "ray.scripts.scripts"]
# Every process of this cluster (its nodes, the drivers that join it) in Ray's token mode: with a token in
# ~/.ray/auth_token a head turns token authentication on by itself, but a driver does so only when asked.
RAY_ENV = {**os.environ, "RAY_AUTH_MODE": "token"}


def _node_ips(address: str) -> list[dict]:
    """Live nodes of the cluster at `address` as (ip, resources), read by a separate driver process."""
    code = (
        f"import json, ray; ray.init(address={address!r}, log_to_driver=False); "
        "print(json.dumps([{'ip': n['NodeManagerAddress'], 'resources': n['Resources']} "
        "for n in ray.nodes() if n['Alive']])); ray.shutdown()"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=RAY_ENV)
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else []


@contextlib.contextmanager
def two_node_cluster() -> Iterator[tuple[str, list[dict]]]:
    """A head node offering `wsh_trainer_node` and a second node (at 127.0.0.2) offering `wsh_engine_node`;
    yields (GCS address, live nodes). Both `ray start --block` commands are ended by pid on the way out."""
    port = free_port()
    temp = tempfile.mkdtemp(prefix="wsh-ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    common = ["--block", "--num-cpus=4", "--disable-usage-stats"]
    procs: list[subprocess.Popen[bytes]] = []
    passed = False
    log = open(Path(temp) / "start.log", "ab")  # noqa: SIM115  (closed below)
    try:
        procs.append(
            subprocess.Popen(
                [
                    *RAY,
                    "start",
                    "--head",
                    f"--port={port}",
                    f"--temp-dir={temp}",
                    "--include-dashboard=false",
                    '--resources={"wsh_trainer_node": 1}',
                    *common,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=RAY_ENV,
            )
        )
        head_ip = None  # the head's node address, as its `ray start` reports it ("Local node IP: ...")
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and head_ip is None and procs[0].poll() is None:
            time.sleep(2)
            found = re.search(r"Local node IP: (\S+)", (Path(temp) / "start.log").read_text())
            head_ip = found.group(1) if found and _node_ips(f"{found.group(1)}:{port}") else None
        assert head_ip is not None, (Path(temp) / "start.log").read_text()[-3000:]
        address = f"{head_ip}:{port}"
        procs.append(
            subprocess.Popen(
                [
                    *RAY,
                    "start",
                    f"--address={address}",
                    f"--node-ip-address={ENGINE_NODE_IP}",
                    '--resources={"wsh_engine_node": 1}',
                    *common,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=RAY_ENV,
            )
        )
        nodes: list[dict] = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and len(nodes) < 2:
            time.sleep(2)
            nodes = _node_ips(address)
        assert len(nodes) == 2, (Path(temp) / "start.log").read_text()[-3000:]
        yield address, nodes
        passed = True
    finally:
        for proc in reversed(procs):  # the second node first, then the head
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # what is left of the group this test started
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        log.close()
        if passed:  # the nodes' session logs stay in /tmp only for a failed test
            shutil.rmtree(temp, ignore_errors=True)


def test_trainer_on_one_node_engines_on_the_other(tmp_path: Path) -> None:
    matrix = tmp_path / "two_nodes.yaml"
    matrix.write_text("- model: qwen3\n  engines: 2\n  syncs: 2\n  chunk_bytes: 262144\n  logprob_temperature: 1.0\n")
    with two_node_cluster() as (address, nodes):
        trainer_ip = next(n["ip"] for n in nodes if "wsh_trainer_node" in n["resources"])
        engine_ip = next(n["ip"] for n in nodes if "wsh_engine_node" in n["resources"])
        assert engine_ip == ENGINE_NODE_IP and trainer_ip != engine_ip
        run = subprocess.run(
            harness_run(matrix, tmp_path, "--ray-address", address, "--run-id", "two-nodes"),
            capture_output=True,
            text=True,
            timeout=1800,
            env=RAY_ENV,
        )
    records = list((tmp_path / "two-nodes" / "records").glob("*.json"))
    assert run.returncode == 0 and len(records) == 1, (run.stdout[-3000:], run.stderr[-3000:])
    rec = RunRecord.load(records[0])
    assert rec.scenario_id == "qwen3/tp1-pp1/noncolocate-engines2/raw"
    assert rec.verdict == "PASS", [c for c in rec.checks if not c["ok"]]
    group = rec.transfer_group
    assert group is not None
    assert group.master_address == trainer_ip != "127.0.0.1"  # the trainer node's address, not loopback
    assert [urlparse(u).hostname for u in group.engine_urls] == [engine_ip, engine_ip]
    assert group.token_required
    assert group.world_size == 3 and group.rank_offsets == [1, 2]
    assert {c.engine for c in rec.http if c.route == "/update_weights"} == {0, 1}
    for s in rec.syncs:  # both engines took every chunk and hold the expected state
        assert [e.engine for e in s.engines] == [0, 1]
        for e in s.engines:
            assert sorted(e.chunks_received) == [c.index for c in s.chunks]
            assert e.engine_checksums == s.expected_checksums
