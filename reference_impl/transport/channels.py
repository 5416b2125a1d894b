"""The sender's channel for an engine's transfer: one place that maps (wire format, backend) to a channel.

Both sides derive the pair from the engine kind (`reference_impl.engine.base.EngineKind.transfer`): the
engine's server for its start flags, the sender (here) for its channel and /init_weight_transfer_engine.

| wire | backend | channel | where |
| --- | --- | --- | --- |
| harness | gloo / nccl | `noncolocate.BroadcastChannel` (header + payload over the transfer group) | CPU / GPU |
| harness | shm / cuda_ipc | `colocate.SharedMemoryChannel` / `colocate.CudaIpcChannel` (handles) | CPU / GPU |
| vllm_packed | gloo | `vllm_packed.PackedBroadcastChannel` over gloo (vLLM's nccl format) | CPU |
| vllm_packed | nccl | `vllm_packed.PackedBroadcastChannel` over NCCL (vLLM's nccl backend) | GPU |
| vllm_packed | ipc | `vllm_packed.VllmIpcChannel` (vLLM's ipc backend) | GPU |
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from wsh_vllm_plugin.protocol import DEFAULT_TIMEOUT_S, InitInfo

from reference_impl.transport.client import EngineClient
from reference_impl.transport.replicas import ReplicaClient
from reference_impl.transport.sync import Channel

LOOPBACK = "127.0.0.1"  # the store's address when every process runs on one node

WIRES = ("harness", "vllm_packed")  # the values of `reference_impl.engine.base.Transfer.wire`


Connect = Callable[["EngineClient | ReplicaClient", float, Sequence[int], str], Channel]


def _group(backend: str) -> Connect:
    def connect(
        client: EngineClient | ReplicaClient, timeout_s: float, engine_ranks: Sequence[int], master_address: str
    ) -> Channel:
        from reference_impl.transport.noncolocate import connect_broadcast

        return connect_broadcast(client, timeout_s, engine_ranks, master_address, backend)

    return connect


def _one_engine(client: EngineClient | ReplicaClient, engine_ranks: Sequence[int]) -> EngineClient:
    """The one engine a colocated sender feeds.

    Raises:
        ValueError: several engines.
    """
    if isinstance(client, ReplicaClient) or len(engine_ranks) != 1:
        n = len(client.clients) if isinstance(client, ReplicaClient) else len(engine_ranks)
        raise ValueError(f"colocate feeds one engine, not {n}")
    return client


def _handles(cuda: bool) -> Connect:
    def connect(
        client: EngineClient | ReplicaClient, timeout_s: float, engine_ranks: Sequence[int], master_address: str
    ) -> Channel:
        from reference_impl.transport.colocate import CudaIpcChannel, SharedMemoryChannel

        one = _one_engine(client, engine_ranks)
        channel: Channel = CudaIpcChannel() if cuda else SharedMemoryChannel()
        one.init_transfer(InitInfo(backend=channel.backend))  # type: ignore[arg-type]
        return channel

    return connect


def _vllm(backend: str) -> Connect:
    def connect(
        client: EngineClient | ReplicaClient, timeout_s: float, engine_ranks: Sequence[int], master_address: str
    ) -> Channel:
        from reference_impl.transport import vllm_packed

        if backend == "gloo":
            return vllm_packed.connect_packed_gloo(client, timeout_s, engine_ranks, master_address)
        if backend == "nccl":
            return vllm_packed.connect_packed_nccl(client, engine_ranks)
        return vllm_packed.connect_vllm_ipc(_one_engine(client, engine_ranks))

    return connect


# (wire, backend) -> connect(client, timeout_s, engine_ranks, master_address): the table of the module doc.
CONNECTORS: dict[tuple[str, str], Connect] = {
    ("harness", "gloo"): _group("gloo"),
    ("harness", "nccl"): _group("nccl"),
    ("harness", "shm"): _handles(cuda=False),
    ("harness", "cuda_ipc"): _handles(cuda=True),
    ("vllm_packed", "gloo"): _vllm("gloo"),
    ("vllm_packed", "nccl"): _vllm("nccl"),
    ("vllm_packed", "ipc"): _vllm("ipc"),
}


def connect_channel(
    client: EngineClient | ReplicaClient,
    wire: str,
    backend: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    engine_ranks: Sequence[int] = (1,),
    master_address: str = LOOPBACK,
) -> Channel:
    """Set up the channel for `wire` / `backend` (table in the module doc), including every engine's
    /init_weight_transfer_engine; `timeout_s`: seconds for a transfer group to form (and, for the
    harness's groups, for every broadcast). `engine_ranks`: each engine's workers in the transfer group
    (its TP), one entry per engine of `client` (a `ReplicaClient` for several; `transport.group`).
    `master_address`: where the engines reach the sender's store. Colocate backends feed one engine.

    Raises:
        ValueError: an unknown pair; `engine_ranks` without one entry per engine; several engines colocated.
        EngineRejected: an engine refused the init call.
        RuntimeError: a GPU backend on a host without CUDA, or the group did not form in time.
    """
    try:
        connect = CONNECTORS[(wire, backend)]
    except KeyError:
        raise ValueError(
            f"no channel for wire {wire!r} and backend {backend!r}: known pairs {sorted(CONNECTORS)}"
        ) from None
    return connect(client, timeout_s, engine_ranks, master_address)
