"""A first-order model of one weight update's wall time: bytes over links, plus fixed costs per HF tensor
and per engine call, phase by phase as the sync runs them (`docs/scaling.md` derives and checks it).

Units: bytes; bandwidths in GB/s (1e9 bytes/s, one direction, achievable rather than nominal); seconds.

The design modelled is the harness's (`reference_impl/transport/sync.py`): every PP stage exports its
tensors (TP all-gather, convert; routed experts stacked into one HF tensor per layer are all-gathered
over EP first, experts named apart stay with their EP rank), one sender (global rank 0) collects the
tensors other ranks own point to point and sends chunk after chunk to the engine, each chunk's engine
call in flight while its bytes travel, with no overlap between collecting, sending and loading. The
phases, in that order and summed:

- export   = gather (dense bytes of a stage x (TP-1)/TP over the TP link, + for stacked experts the
             expert bytes of a stage x (EP-1)/EP over the EP link) + convert (a stage's bytes through one
             copy) + a stage's HF tensors x (`tensor_s`, plus `collective_s` when a gather runs: one
             all-gather per tensor). Stages export in parallel: one stage's time counts.
- handoff  = bytes x (PP-1)/PP into the sender over the PP link (every other stage's bytes), + for
             experts named apart the expert bytes of a stage x (EP-1)/EP over the EP link (the other EP
             ranks' experts), plus `collective_s` per tensor handed over (one point-to-point message
             each; the expert tensors counted by their share of the bytes).
- transfer = non-colocate over gloo (the bytes go through host memory): pack (device -> host over
             PCIe on GPU, a host copy on CPU) + every engine worker receives all bytes over TCP, one
             after the other + host -> device over PCIe on the engine's GPU; over NCCL: a pipelined ring
             broadcast of all bytes over NVLink (engine on the sender's node) or InfiniBand, plus one
             chunk per extra receiver. Colocate: pack into the shared buffer (one copy).
- load     = each engine worker copies its shard (bytes / engine TP) into its parameters.
- calls    = (chunks + 4) engine calls x `call_s` (start, one per chunk, finish, two cache resets).

What would change it is a `Design` flag: `per_stage_senders` (each stage's leader sends its own
bytes: no handoff, the transfer of PP stages runs in parallel), `sharded_engine` (each engine TP rank
receives only its shard), `overlap` (collect, send and load pipelined: the slowest stream instead of
the sum).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

GB = 1e9
ENGINE_CALLS_PER_SYNC = 4  # /start_weight_update, /finish_weight_update, two cache resets


@dataclass(frozen=True)
class Links:
    """Achievable one-direction bandwidths (GB/s) and fixed costs (s) of a machine."""

    name: str
    nvlink: float  # GPU <-> GPU inside a node (per GPU)
    pcie: float  # host <-> GPU (per GPU)
    ib: float  # across nodes (per GPU NIC)
    memcpy: float  # host memory copy, one thread
    hbm_copy: float  # on-device copy
    tcp: float  # one gloo (TCP) stream between two processes
    call_s: float  # one engine HTTP call, round trip
    tensor_s: float  # fixed cost per HF tensor on the export path (Python, conversion)
    collective_s: float  # fixed cost of one small collective or point-to-point message between ranks
    gpus_per_node: int = 8


@dataclass(frozen=True)
class Topology:
    """Trainer TP x PP (x EP), engine replicas x engine TP, placement, device and transfer backend."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    replicas: int = 1
    engine_tp: int = 1
    colocate: bool = False
    device: str = "gpu"  # "gpu" | "cpu"
    transfer: str = "gloo"  # non-colocate transfer group: "gloo" (what the harness has) | "nccl"
    engine_same_node: bool = True  # the engine's GPUs are on the sender's node (NVLink) or not (IB)

    @property
    def trainer_world(self) -> int:
        """Trainer ranks: PP x lcm(TP, EP) (ETP 1)."""
        return self.pp * math.lcm(self.tp, self.ep)

    @property
    def receivers(self) -> int:
        """Engine workers that receive every chunk: replicas x engine TP."""
        return self.replicas * self.engine_tp


@dataclass(frozen=True)
class Design:
    """The harness's design is all false; each flag is one fix `docs/scaling.md` discusses."""

    per_stage_senders: bool = False
    sharded_engine: bool = False
    overlap: bool = False


@dataclass(frozen=True)
class Workload:
    """One sync: HF bytes (`expert_bytes` of them routed experts), HF tensors and the chunk size;
    `stacked_experts`: the HF layout stacks a layer's experts into one tensor (Qwen3-VL-MoE), so the export
    all-gathers them over EP (`FamilyTable.ep_gathers_experts`)."""

    bytes: int
    tensors: int
    chunk_bytes: int
    expert_bytes: int = 0
    stacked_experts: bool = False


@dataclass(frozen=True)
class Prediction:
    """Seconds per phase (`export`, `handoff`, `transfer`, `load`, `calls`) and their total."""

    phases: dict[str, float] = field(default_factory=dict)
    total: float = 0.0

    @property
    def bottleneck(self) -> str:
        """The phase with the most seconds."""
        return max(self.phases, key=lambda k: self.phases[k])


def _link(links: Links, topo: Topology, ranks: int) -> float:
    """GB/s between trainer ranks of a group of `ranks` (gloo over TCP on CPU; NVLink inside a node)."""
    if topo.device == "cpu":
        return links.tcp
    return links.nvlink if ranks <= links.gpus_per_node else links.ib


def _copy(links: Links, topo: Topology) -> float:
    return links.memcpy if topo.device == "cpu" else links.hbm_copy


def export_s(w: Workload, topo: Topology, links: Links) -> float:
    """One stage's export: gather, convert and per-tensor costs (module doc)."""
    stage = w.bytes / topo.pp
    dense, experts = (w.bytes - w.expert_bytes) / topo.pp, w.expert_bytes / topo.pp
    gather = dense * (topo.tp - 1) / topo.tp / (_link(links, topo, topo.tp) * GB)
    ep_gather = topo.ep > 1 and w.stacked_experts
    if ep_gather:
        gather += experts * (topo.ep - 1) / topo.ep / (_link(links, topo, topo.ep * topo.tp) * GB)
    convert = stage / (_copy(links, topo) * GB)
    per_tensor = links.tensor_s + (links.collective_s if topo.tp > 1 or ep_gather else 0.0)
    return gather + convert + w.tensors / topo.pp * per_tensor


def handoff_s(w: Workload, topo: Topology, links: Links, design: Design) -> float:
    """The sender's intake of what other ranks own: every other stage's bytes (none with per-stage
    senders, where each stage's leader sends its own), and the other EP ranks' experts of its stage where
    the experts are named apart (module doc)."""
    seconds = 0.0
    if topo.pp > 1 and not design.per_stage_senders:
        share = (topo.pp - 1) / topo.pp
        seconds += w.bytes * share / (_link(links, topo, topo.trainer_world) * GB)
        seconds += w.tensors * share * links.collective_s
    if topo.ep > 1 and not w.stacked_experts and w.expert_bytes:
        share = (topo.ep - 1) / topo.ep / topo.pp
        seconds += w.expert_bytes * share / (_link(links, topo, topo.ep * topo.tp) * GB)
        seconds += w.tensors * (w.expert_bytes / w.bytes) * share * links.collective_s
    return seconds


def transfer_s(w: Workload, topo: Topology, links: Links, design: Design) -> float:
    """Pack and move the bytes to every engine worker (module doc)."""
    senders = topo.pp if design.per_stage_senders else 1
    per_sender = w.bytes / senders
    ingress = per_sender / (topo.engine_tp if design.sharded_engine else 1)
    if topo.colocate:
        return per_sender / (_copy(links, topo) * GB)
    if topo.transfer == "gloo":
        pack = per_sender / ((links.memcpy if topo.device == "cpu" else links.pcie) * GB)
        wire = topo.receivers * ingress / (links.tcp * GB)
        unpack = 0.0 if topo.device == "cpu" else ingress / (links.pcie * GB)
        return pack + wire + unpack
    if topo.transfer == "nccl":
        bw = (links.nvlink if topo.engine_same_node else links.ib) * GB
        return ingress / bw + (topo.receivers - 1) * min(w.chunk_bytes, ingress) / bw
    raise ValueError(f"unknown transfer backend {topo.transfer!r}; use gloo or nccl")


def load_s(w: Workload, topo: Topology, links: Links) -> float:
    """Each engine worker copies its shard into its parameters."""
    return w.bytes / topo.engine_tp / (_copy(links, topo) * GB)


def calls_s(w: Workload, links: Links) -> float:
    """Engine calls: one per chunk plus the per-sync ones."""
    return (math.ceil(w.bytes / w.chunk_bytes) + ENGINE_CALLS_PER_SYNC) * links.call_s


def predict(w: Workload, topo: Topology, links: Links, design: Design | None = None) -> Prediction:
    """Seconds of one steady-state update (module doc). With `design.overlap` the streaming phases
    (handoff, transfer, load) run as a pipeline and count as their maximum.

    Raises:
        ValueError: an unknown transfer backend.
    """
    design = design or Design()
    phases = {
        "export": export_s(w, topo, links),
        "handoff": handoff_s(w, topo, links, design),
        "transfer": transfer_s(w, topo, links, design),
        "load": load_s(w, topo, links),
        "calls": calls_s(w, links),
    }
    if design.overlap:
        stream = max(phases["handoff"], phases["transfer"], phases["load"])
        total = phases["export"] + stream + phases["calls"]
    else:
        total = sum(phases.values())
    return Prediction(phases=phases, total=total)


# Chunks the sender holds unanswered before its export waits (`reference_impl.transport.sync.QUEUE_DEPTH`;
# tests/test_scale_model.py asserts the two agree).
SENDER_QUEUE_DEPTH = 2


def sender_held_bytes(w: Workload, topo: Topology) -> int:
    """Bytes of exported tensors the sender's chunk loop holds at most: the `SENDER_QUEUE_DEPTH` chunks still
    unanswered and the one it fills meanwhile, never more than its stage's export (`B/PP`). Not counted: the
    raw export's kept gather buffers (`trainer.params.GatherBuffers`), which hold the gathered tensors it
    hands on from one export to the next."""
    return min(w.bytes // topo.pp, (SENDER_QUEUE_DEPTH + 1) * w.chunk_bytes)


def with_links(links: Links, **changes: float) -> Links:
    """`links` with some numbers replaced (e.g. a measured TCP bandwidth)."""
    return replace(links, **changes)
