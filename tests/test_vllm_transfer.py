"""Which transfer each engine kind speaks on each placement and host, the channel the sender builds for it,
and the flags vLLM's server is started with for it (what runs on GPU hosts is checked here as data)."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from reference_impl.engine import engine_kind
from reference_impl.engine.base import Transfer
from reference_impl.engine.vllm.env import EngineEnvMissing, plugin_import_dir
from reference_impl.engine.vllm.launcher import (
    COLOCATE_GPU_MEMORY_UTILIZATION,
    VllmEngineProcess,
    backend_flags,
    cpu_worker_threads,
)
from reference_impl.transport.channels import CONNECTORS, connect_channel

PLACEMENTS = [(False, False), (False, True), (True, False), (True, True)]  # (colocate, cuda)


def test_each_engine_kind_names_its_transfer() -> None:
    embedded = {p: engine_kind("embedded").transfer(*p) for p in PLACEMENTS}
    assert embedded == {
        (False, False): Transfer("harness", "gloo"),
        (False, True): Transfer("harness", "nccl"),
        (True, False): Transfer("harness", "shm"),
        (True, True): Transfer("harness", "cuda_ipc"),
    }
    vllm = engine_kind("vllm")
    assert vllm.transfer(False, False) == Transfer("vllm_packed", "gloo")  # the plugin's backend on CPU
    assert vllm.transfer(False, True) == Transfer("vllm_packed", "nccl")  # vLLM's own, unmodified
    assert vllm.transfer(True, True) == Transfer("vllm_packed", "ipc")


def test_every_transfer_has_a_channel_and_nothing_else_does() -> None:
    pairs = {
        (t.wire, t.backend) for k in ("embedded", "vllm") for p in PLACEMENTS for t in [engine_kind(k).transfer(*p)]
    }
    assert pairs <= set(CONNECTORS)
    with pytest.raises(ValueError, match="no channel for wire 'vllm_packed' and backend 'shm'"):
        connect_channel(None, "vllm_packed", "shm")  # type: ignore[arg-type]


def test_backend_flags_per_backend() -> None:
    assert backend_flags("gloo", False) == (["--weight-transfer-config", '{"backend": "gloo"}'], {})
    assert backend_flags("nccl", False) == (["--weight-transfer-config", '{"backend": "nccl"}'], {})
    args, env = backend_flags("ipc", True)
    assert args == ["--weight-transfer-config", '{"backend": "ipc"}', "--gpu-memory-utilization",
                    str(COLOCATE_GPU_MEMORY_UTILIZATION)]  # fmt: skip
    assert env == {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # vLLM unpickles ipc handles only then
    for backend, colocate in (("ipc", False), ("nccl", True), ("gloo", True)):
        with pytest.raises(ValueError, match="ipc backend is the colocate one"):
            backend_flags(backend, colocate)
    with pytest.raises(ValueError, match="unknown"):
        backend_flags("sparse_nccl", False)


def test_vllms_server_gets_the_backend_and_this_checkouts_plugin(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    proc = VllmEngineProcess("/ckpt", 7, None, dtype="bfloat16", backend="ipc", colocate=True)
    try:
        argv, env, _, _ = proc.launch()
    except EngineEnvMissing as e:
        if os.environ.get("WSH_REQUIRE_VLLM") == "1":
            pytest.fail(f"WSH_REQUIRE_VLLM=1 but {e}")
        pytest.skip(str(e))
    config = argv[argv.index("--weight-transfer-config") + 1]
    assert json.loads(config) == {"backend": "ipc"}
    assert argv[argv.index("--gpu-memory-utilization") + 1] == str(COLOCATE_GPU_MEMORY_UTILIZATION)
    assert env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["PYTHONPATH"] == str(plugin_import_dir())
    # torch's inductor cache where torch itself puts it for this process, not in the server's TMPDIR (removed by
    # stop): vLLM's sampler compiles a kernel at the first log-prob request, and every start recompiled it
    assert env["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir()
    assert not env["TORCHINDUCTOR_CACHE_DIR"].startswith(str(proc.server_temp_dir()))
    assert "TORCHDYNAMO_DISABLE" not in env  # a GPU server compiles as vLLM does
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env  # and runs its workers as vLLM does
    proc.stop()  # never started: removes the temp folder `launch` made (its working folder)
    mine = VllmEngineProcess("/ckpt", 7, None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    mine_env = mine.launch()[1]
    assert mine_env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path) and mine_env["TORCHDYNAMO_DISABLE"] == "0"  # kept
    assert mine_env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"  # kept
    mine.stop()
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    plain_proc = VllmEngineProcess("/ckpt", 7, None)
    plain, plain_env = plain_proc.launch()[:2]
    plain_proc.stop()
    # a CPU server: the sampler's rank count runs uncompiled (its compile took 7-16 s of the first log-prob request)
    assert plain_env["TORCHDYNAMO_DISABLE"] == "1"
    # and its one worker runs inside the engine core (a worker process was one more 6-8 s import of torch and vLLM)
    assert plain_env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    # with the thread count vLLM gives a worker process it spawns: every allowed CPU but one, at least one
    assert plain_env["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) - 1))
    assert (cpu_worker_threads([0]), cpu_worker_threads([0, 1]), cpu_worker_threads(list(range(16)))) == (1, 1, 15)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    bound_proc = VllmEngineProcess("/ckpt", 7, None)
    bound_env = bound_proc.launch()[1]
    bound_proc.stop()
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in bound_env  # a binding asked for needs vLLM's worker process
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    tp2_proc = VllmEngineProcess("/ckpt", 7, None, tp=2)
    tp2_env = tp2_proc.launch()[1]
    tp2_proc.stop()
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in tp2_env  # TP workers are processes, as vLLM runs them
    assert json.loads(plain[plain.index("--weight-transfer-config") + 1]) == {"backend": "gloo"}
    assert "--gpu-memory-utilization" not in plain


def test_the_gpu_matrix_drives_vllms_two_backends_and_the_embedded_engines_nccl_group() -> None:
    from harness.scenario import load_matrix

    transfers = {(s.engine, engine_kind(s.engine).transfer(s.colocate, cuda=True)) for s in load_matrix("gpu")}
    assert transfers == {
        ("vllm", Transfer("vllm_packed", "nccl")),
        ("vllm", Transfer("vllm_packed", "ipc")),
        ("embedded", Transfer("harness", "nccl")),
        ("embedded", Transfer("harness", "cuda_ipc")),
    }


def test_the_harness_protocol_names_an_nccl_group_for_gpu_hosts() -> None:
    """The embedded engine's non-colocate backend on GPU: the same rules as gloo; joining needs CUDA."""
    import torch
    from wsh_vllm_plugin import protocol
    from wsh_vllm_plugin.group import host_store, join_transfer_group

    assert protocol.GROUP_BACKENDS == ("gloo", "nccl") and "nccl" in protocol.BACKENDS
    with pytest.raises(protocol.ProtocolError, match="Field required for backend 'nccl'") as e:
        protocol.InitInfo(backend="nccl", master_port=1).check()
    assert (e.value.field, e.value.required) == ("master_address", True)
    with pytest.raises(ValueError, match="transfer group backend 'shm'"):
        join_transfer_group("127.0.0.1", 1, 0, 2, backend="shm")
    if not torch.cuda.is_available():
        store = host_store(timeout_s=5)
        with pytest.raises(RuntimeError, match="needs a CUDA device; use 'gloo' on CPU"):
            join_transfer_group("127.0.0.1", store.port, 0, 2, timeout_s=5, store=store, backend="nccl")


class _VllmWorkers:
    """Stands in for one vLLM engine with `tp` workers on /init_weight_transfer_engine: each worker joins the
    group as rank_offset + its TP rank (vLLM `nccl_common.py`), then takes one packed buffer of `nbytes`."""

    def __init__(self, engine: int, tp: int, nbytes: int) -> None:
        self.engine, self.tp, self.nbytes = engine, tp, nbytes
        self.bodies: list[dict] = []
        self.received: dict[int, bytes] = {}
        self.threads: list[threading.Thread] = []

    def init_transfer(self, body: dict) -> dict:
        from wsh_vllm_plugin.group import join_transfer_group
        from wsh_vllm_plugin.protocol import SENDER_RANK

        self.bodies.append(body)

        def worker(w: int) -> None:
            rank = body["rank_offset"] + w
            group = join_transfer_group(body["master_address"], body["master_port"], rank, body["world_size"], 30.0)
            buf = torch.empty(self.nbytes, dtype=torch.uint8)
            group.broadcast(buf, SENDER_RANK)
            self.received[rank] = buf.numpy().tobytes()

        self.threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(self.tp)]
        for t in self.threads:
            t.start()
        return {}


def test_vllm_replicas_with_tp_workers_join_one_group_at_their_own_offsets() -> None:
    """Two vLLM engines, TP 2 and TP 1, fed by one gloo group in vLLM's protocol: engine 0's workers are
    ranks 1 and 2, engine 1's rank 3, of 4; every worker takes the same packed bytes."""
    from reference_impl.transport.replicas import ReplicaClient
    from reference_impl.transport.vllm_packed import connect_packed_gloo

    payload = torch.arange(24, dtype=torch.float32)
    engines = [_VllmWorkers(0, 2, payload.numel() * 4), _VllmWorkers(1, 1, payload.numel() * 4)]
    channel = connect_packed_gloo(ReplicaClient(engines), 30.0, engine_ranks=[2, 1])  # type: ignore[list-item]
    channel.sender.send([payload], [payload.numel() * 4])
    for e in engines:
        for t in e.threads:
            t.join(30)
    assert [(b["rank_offset"], b["world_size"], b["packed"]) for e in engines for b in e.bodies] == [
        (1, 4, True),
        (3, 4, True),
    ]
    assert channel.init_infos == [e.bodies[0] for e in engines]
    assert sorted(engines[0].received) == [1, 2] and sorted(engines[1].received) == [3]
    want = payload.numpy().tobytes()
    assert all(got == want for e in engines for got in e.received.values())
    with pytest.raises(ValueError, match="2 engines but transfer-group ranks for \\[1\\]"):
        connect_packed_gloo(ReplicaClient(engines), 30.0, engine_ranks=[1])  # type: ignore[list-item]
    channel.close()
