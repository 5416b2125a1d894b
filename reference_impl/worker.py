"""One trainer rank: the object the runner places as a Ray actor (one per rank).

It composes the trainer (Megatron model and parallel state), the export modes and the transport into
what an RL framework runs after every step. Lifecycle per scenario: `setup` (Megatron parallel state,
model built and loaded from the checkpoint) -> `connect_engine` (sender only: the transfer group) ->
`sync` x N with `perturb` between them -> `export_checksums` (raw and bridge on the same state) ->
`teardown`. The process and its default process group are reused across scenarios of the same world
size.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from reference_impl import seams
from reference_impl.checksum import tensor_checksum
from reference_impl.cuda import cuda_available
from reference_impl.engine import engine_kind
from reference_impl.export import stream
from reference_impl.export.stream import convert_config
from reference_impl.memory import release_memory
from reference_impl.models.families import model_family
from reference_impl.models.registry import load_model
from reference_impl.priority import in_lowest_priority_thread
from reference_impl.trainer import step as train_step
from reference_impl.trainer.model import TrainerModel, build_model, import_megatron
from reference_impl.trainer.parallel import RankLayout, destroy_model_parallel, init_distributed, init_model_parallel
from reference_impl.trainer.params import iter_global_params, kept_gather_buffers
from reference_impl.transport import bound, sync
from reference_impl.transport.channels import connect_channel
from reference_impl.transport.client import EngineClient
from reference_impl.transport.noncolocate import LOOPBACK
from reference_impl.transport.observed import HttpCall, SyncReport
from reference_impl.transport.plan import Chunk
from reference_impl.transport.progress import Progress
from reference_impl.transport.replicas import ReplicaClient
from reference_impl.transport.sync import SENDER, Channel


@dataclass(frozen=True)
class TrainerSetup:
    """What one scenario asks of the trainer ranks: the model entry, its checkpoint folder, the dtype
    name, and the parallel layout (TP x PP, EP x ETP for experts)."""

    model: str
    checkpoint: str
    dtype: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    # Where each rank keeps its progress line (`rank<r>.txt`) and the sender its call log
    # (`rank<r>.calls.jsonl`), for the watchdog and for the calls of a sync that never returns.
    trace_dir: str | None = None


def talks_to_engine(rank: int, layout: RankLayout | None) -> bool:
    """Whether this trainer rank is the one that sets up the channel to the engine and sends (global rank
    0, the sender; the other ranks hand their tensors to it). A seam (`reference_impl.seams`)."""
    return rank == SENDER


class TrainerWorker:
    """One trainer rank (see module doc). Methods return plain data (dicts) for the runner."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        torch.set_num_threads(1)
        self.rank, self.world_size = rank, world_size
        init_distributed(rank, world_size, master_addr, master_port)
        self.model: TrainerModel | None = None
        self.layout: RankLayout | None = None
        self.client: EngineClient | ReplicaClient | None = None
        self.channel: Channel | None = None
        self.checkpoint = ""
        self.trace_dir: Path | None = None
        self.progress = Progress(None)
        self.last_plan: list[Chunk] = []
        # the raw export's gather outputs, kept from sync to sync on a host (not on a GPU: `kept_gather_buffers`)
        self.gather_buffers = kept_gather_buffers(cuda_available())
        # What runs at the trainer's seams in this process before any fault could be applied to it.
        self.unfaulted = seams.snapshot()

    def pid(self) -> int:
        """OS process id (for stack dumps and cleanup)."""
        return os.getpid()

    def log_path(self) -> str | None:
        """The file this process's standard error goes to (Ray's `worker-*.err` in the session's logs), or
        None where it is not a regular file. Asked when the rank starts: a rank that dies below Python (gloo's
        C++ abort on a message of the wrong size, a segfault) leaves its cause only there, while Ray tells
        the driver just `ActorDiedError` (`harness.rank_logs`)."""
        path = os.path.realpath("/proc/self/fd/2")
        return path if os.path.isfile(path) else None

    def warm(self) -> float:
        """Import what this process's first `setup` imports (`trainer.model.import_megatron`), ahead of any
        scenario: the ranks of a spare pool do it while other scenarios run (`harness.runner.Runner`,
        `spare_pools`), in a thread of its own at the lowest priority, where it may return to the rank's priority
        afterwards (`priority.in_lowest_priority_thread`; the runner raises that thread to the rank's priority
        when it takes the spare). Returns the seconds it took."""
        t0 = time.perf_counter()
        in_lowest_priority_thread(import_megatron)
        return time.perf_counter() - t0

    def setup(self, setup: TrainerSetup) -> dict[str, Any]:
        """Build this rank's shard of the model and load the checkpoint into it. Returns timings (s)."""
        self.teardown()
        t0 = time.perf_counter()
        self.checkpoint = setup.checkpoint
        self.trace_dir = Path(setup.trace_dir) if setup.trace_dir else None
        self.progress = Progress(self.trace_dir / f"rank{self.rank}.txt" if self.trace_dir else None)
        self.progress.at("setup: building the Megatron model and loading the checkpoint")
        self.spec = load_model(setup.model)
        self.layout = init_model_parallel(setup.tp, setup.pp, setup.ep, setup.etp)
        self.model = build_model(
            Path(setup.checkpoint),
            self.spec.model_type,
            setup.tp,
            setup.pp,
            setup.dtype,
            setup.ep,
            setup.etp,
            pad_vocab=self.spec.pad_vocab,
        )
        self.convert_config = convert_config(self.spec, Path(setup.checkpoint))
        return {"rank": self.rank, "build_s": time.perf_counter() - t0, "layout": asdict(self.layout)}

    def connect_engine(
        self,
        base_url: str | Sequence[str],
        engine: str,
        colocate: bool = False,
        timeout_s: float = 120.0,
        engine_ranks: Sequence[int] | None = None,
        master_address: str = LOOPBACK,
        token: str | None = None,
    ) -> list[HttpCall]:
        """Sender only: set up the channel to the engines (of kind `engine`, `reference_impl.engine`) through
        /init_weight_transfer_engine, in the wire format and backend the engine kind names for this
        placement and host (`EngineKind.transfer`, `transport.channels`).

        `base_url`: one engine's base URL, or one per engine replica (then every update route is fanned out
        to all of them, `transport.replicas`). `engine_ranks`: each engine's workers in the transfer group
        (its TP; default 1 each). `master_address`: where the engines reach the sender's transfer-group store
        (this rank's node address; 127.0.0.1 when everything runs on one node). `token`: the run's bearer
        token for every engine call (None: no Authorization header).

        Non-colocate: one transfer group of the sender and every engine worker (gloo on CPU, NCCL on GPU);
        the HTTP calls block until the engines joined, so they run in threads while this rank joins as rank
        0. Colocate (one engine): a buffer passed by handle; the engine has nothing to join. Returns the HTTP
        calls made.
        """
        if not talks_to_engine(self.rank, self.layout):
            return []
        kind = engine_kind(engine)  # e.g. whether a failed chunk ends the session (see transport.client)
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        clients = [
            EngineClient(
                url,
                session_ends_on_error=kind.capabilities.session_ends_on_error,
                parse_rejections=kind.parse_rejections,
                rank=self.rank,
                call_log=self.trace_dir / f"rank{self.rank}.calls.jsonl" if self.trace_dir else None,
                engine=i,
                token=token,
                pauses_generation=not kind.capabilities.refuses_completions_in_session,
            )
            for i, url in enumerate(urls)
        ]
        self.client = clients[0] if len(clients) == 1 else ReplicaClient(clients)
        self.progress.at("connect: /init_weight_transfer_engine in flight")
        transfer = kind.transfer(colocate, cuda_available())  # as the engine's launcher asks (adapter.server)
        ranks = list(engine_ranks) if engine_ranks is not None else [1] * len(urls)
        self.channel = connect_channel(self.client, transfer.wire, transfer.backend, timeout_s, ranks, master_address)
        return self._drain_calls()

    def transfer_group(self) -> list[dict[str, Any]]:
        """Sender, non-colocate: the `init_info` each engine was sent to join the transfer group, as dicts
        (its rank offset, the group's world size, the master address: the harness's `InitInfo`, or vLLM's
        init_info body as sent); [] on every other rank."""
        infos = getattr(self.channel, "init_infos", [])
        return [dict(info) if isinstance(info, dict) else asdict(info) for info in infos]

    def _drain_calls(self) -> list[HttpCall]:
        if self.client is None:
            return []
        calls, self.client.calls = self.client.calls, []
        return calls

    def sync(
        self, index: int, weight_version: int, export_mode: str, chunk_bytes: int
    ) -> tuple[SyncReport, list[HttpCall]]:
        """Export (`export_mode`: raw | bridge) and send one sync in chunks of at most `chunk_bytes`. Returns
        what this rank observed and the engine calls it made (the sender's; none on other ranks)."""
        assert self.model is not None and self.layout is not None
        t0 = time.perf_counter()
        self.progress.at(f"sync {index}: {export_mode} export (gather and convert)")
        ex = stream.export(export_mode, self.model, self.layout, self.convert_config, buffers=self.gather_buffers)
        named, phases = ex.tensors, ex.phases
        t_export = time.perf_counter() - t0
        res, self.last_plan = sync.run_sync(
            named=named,
            rank=self.rank,
            world_size=self.world_size,
            chunk_bytes=chunk_bytes,
            sync_index=index,
            weight_version=weight_version,
            client=self.client,
            channel=self.channel,
            progress=self.progress,
        )
        res.phases = {**phases, **{k: v + phases.get(k, 0.0) for k, v in res.phases.items()}}
        res.total_s += t_export
        res.export_mode = ex.export_mode  # the mode that ran (a check compares it with the one requested)
        if isinstance(self.client, ReplicaClient):  # the sender's account of every engine replica
            res.engines = self.client.accounts(index)
        return res, self._drain_calls()

    def measure_bound(self, repeats: int = 3) -> tuple[dict[str, float | None], list[HttpCall]]:
        """Collective on every rank, after a sync: the same-run bound of that sync's bytes (`transport.bound`),
        the best of `repeats` measurements of each part after one untimed warm-up (the first touch of the
        bound's fresh buffers pays page faults the reference path's kept buffers no longer pay: it is not
        the bound's noise). Returns, on the sender, {"gather_s", "wire_s", "gather_repeats_s",
        "wire_repeats_s"} (seconds: the fastest timed repeat of each part, and every timed repeat in order; the
        wire's None and [] where the channel has no bare counterpart) and the engine calls it made; on every
        other rank ({}, []).

        Raises:
            RuntimeError: no sync ran yet in this scenario (no plan to measure).
        """
        assert self.model is not None and self.layout is not None
        if not self.last_plan:
            raise RuntimeError("measure_bound needs a finished sync of this scenario: call sync() first")
        self.progress.at("bound: bare gathers, hand-offs and chunk transfers of the last sync's sizes")
        num_experts = self.convert_config.num_experts
        ep_gathers = model_family(self.model.model_type).raw.ep_gathers_experts
        gathers = [
            bound.gather_bound(
                self.model, self.layout, num_experts, self.last_plan, self.rank, self.world_size, ep_gathers
            )
            for _ in range(1 + repeats)
        ][1:]
        if self.rank != SENDER:
            return {}, []
        assert self.channel is not None and self.client is not None
        sizes = [c.nbytes for c in self.last_plan]
        wires = [bound.wire_bound(self.channel, self.client, sizes) for _ in range(1 + repeats)][1:]
        timed = [w for w in wires if w is not None] if all(w is not None for w in wires) else []
        parts = {
            "gather_s": min(gathers),
            "wire_s": min(timed) if timed else None,
            "gather_repeats_s": gathers,
            "wire_repeats_s": timed,
        }
        return parts, self._drain_calls()

    def trainer_logprobs(self, temperature: float) -> dict[str, Any]:
        """Collective on every rank: the trainer's own log-probs of the fixed prompts at `temperature`,
        from its Megatron model (`forward.megatron`: the pipeline schedule, vocab-parallel fused log-probs).

        Returns, on global rank 0, {"forward": name, "prompts": [[logprob of token t+1 given tokens <= t,
        ...], ...]} (prompts as `forward.hf.fixed_prompts` orders them); {} on every other rank.
        """
        from reference_impl.forward import megatron
        from reference_impl.forward.hf import fixed_prompts

        assert self.model is not None
        self.progress.at("trainer log-probs: the Megatron forward of the fixed prompts")
        config = json.loads((Path(self.checkpoint) / "config.json").read_text())
        out = megatron.megatron_logprobs(self.model, fixed_prompts(config), temperature)
        return {"forward": megatron.FORWARD_NAME, "prompts": out} if out is not None else {}

    def perturb(self, step: int, seed: int) -> None:
        """Deterministic weight change standing in for a training step: every parameter goes through
        `trainer.step.step` (elementwise, a function of each value, the step index and the seed only), so
        the harness can compute the state every export must produce from the checkpoint alone."""
        assert self.model is not None
        self.progress.at(f"step {step}: the trainer's step on every parameter")
        train_step.apply(iter_global_params(self.model.chunks), step, seed)

    def export_checksums(self, export_mode: str) -> dict[str, str]:
        """Checksums of every HF tensor `export_mode` exports from the current state (complete on the sender)."""
        assert self.model is not None and self.layout is not None
        self.progress.at(f"second export path: {export_mode} export of the last state (gather and convert)")
        ex = stream.export(export_mode, self.model, self.layout, self.convert_config, buffers=self.gather_buffers)
        mine = {n: tensor_checksum(t) for n, t in ex.tensors}
        if self.world_size == 1:
            return mine
        everyone: list[dict[str, str] | None] = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        merged: dict[str, str] = {}
        for d in everyone:
            merged.update(d or {})
        return merged if self.rank == SENDER else {}

    def teardown(self) -> None:
        """Drop the model, the engine client and the transfer group; keep the default group."""
        if self.client is not None:
            self.client.close()
        if self.channel is not None:
            self.channel.close()
        self.client = None
        self.channel = None
        self.model = None
        self.last_plan = []
        self.gather_buffers = kept_gather_buffers(cuda_available())
        destroy_model_parallel()
        release_memory()

    def replaced_seams(self) -> list[str]:
        """The trainer seams at which this process runs something else than it ran when it started
        (`seams.replaced_since`): empty once every fault applied here has been undone."""
        return seams.replaced_since(self.unfaulted)

    def run_in_process(self, fn: Callable[[], Any] | str) -> Any:
        """Call `fn()` in this rank's process, `fn` a callable or `MODULE:FUNCTION` (the runner applies and
        undoes a scenario's fault injection this way)."""
        if isinstance(fn, str):
            module, _, name = fn.partition(":")
            fn = getattr(importlib.import_module(module), name)
        return fn()
