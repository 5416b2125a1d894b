"""Which transfer each engine kind speaks on each placement and host, the channel the sender builds for it,
and the flags vLLM's server is started with for it (what runs on GPU hosts is checked here as data)."""

from __future__ import annotations

import json
import os

import pytest

from reference_impl.engine import engine_kind
from reference_impl.engine.base import Transfer
from reference_impl.engine.vllm.env import EngineEnvMissing, plugin_import_dir
from reference_impl.engine.vllm.launcher import COLOCATE_GPU_MEMORY_UTILIZATION, VllmEngineProcess, backend_flags
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


def test_vllms_server_gets_the_backend_and_this_checkouts_plugin(tmp_path: object) -> None:
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
    plain = VllmEngineProcess("/ckpt", 7, None).launch()[0]
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

    assert protocol.GROUP_BACKENDS == ("gloo", "nccl") and "nccl" in protocol.BACKENDS
    with pytest.raises(protocol.ProtocolError, match="Field required for backend 'nccl'") as e:
        protocol.InitInfo(backend="nccl", master_port=1).check()
    assert (e.value.field, e.value.required) == ("master_address", True)
    with pytest.raises(ValueError, match="transfer group backend 'shm'"):
        protocol.join_transfer_group("127.0.0.1", 1, 0, 2, backend="shm")
    if not torch.cuda.is_available():
        store = protocol.host_store(timeout_s=5)
        with pytest.raises(RuntimeError, match="needs a CUDA device; use 'gloo' on CPU"):
            protocol.join_transfer_group("127.0.0.1", store.port, 0, 2, timeout_s=5, store=store, backend="nccl")
