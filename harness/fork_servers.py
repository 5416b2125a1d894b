"""The fork servers a runner owns: one for its trainer ranks, one for its embedded engine servers.

A fork server (`reference_impl.fork_server`) imports a role's modules once and forks each new process from
there, instead of each process importing them (7-9 s of CPU apiece on a 2-core host). Both run on the
driver's node and carry the driver's Ray tag (`driver_ray.ray_tag_env`), so what they fork is found as the
Ray's processes are (`end_leftovers`). On a GPU host ranks never fork (CUDA does not survive a fork).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import ray

from harness.driver_ray import ray_tag_env
from harness.placement import use_gpus
from harness.record import RunRecord
from reference_impl.engine import EngineKind
from reference_impl.engine.embedded.forked import ROLE as ENGINE_ROLE
from reference_impl.fork_client import ForkServerAddress, ForkServerError
from reference_impl.fork_server import ForkServer
from reference_impl.trainer.forked_rank import ROLE as RANK_ROLE


@dataclass
class ForkServers:
    """Where a runner's new trainer ranks and engine servers fork from, started at their first use and stopped
    by `stop`; logs in `logs_dir` (`rank-fork-server.log`, `fork-server.log`).

    `engines`: engine servers of kinds that can (`EngineKind.forks_from_fork_server`, the embedded engine) are
    forked: from `engine_address` when given (an owner's fork server, e.g. a test session's), else from one
    started here. Actors on other nodes start their servers as new processes. False: all do.
    `ranks`: trainer ranks' Ray workers are forked from a fork server of role
    `reference_impl.trainer.forked_rank`, which imported torch, megatron-core and Megatron-Bridge once. False:
    never."""

    logs_dir: Path
    engines: bool = True
    engine_address: ForkServerAddress | None = None
    ranks: bool = True
    _engine_server: ForkServer | None = None
    _rank_server: ForkServer | None = None

    def for_ranks(self) -> ForkServerAddress | None:
        """Where new trainer ranks fork from, None where they start as new interpreters (`ranks` False, a GPU
        host, or the rank fork server ended: its log says why, and from then on ranks start as new
        interpreters). Starts the rank fork server the first time, without waiting for its imports: the
        first ranks wait for them in their launcher (`fork_client.exec_forked`) while the caller goes on."""
        if not self.ranks or use_gpus():
            return None
        if self._rank_server is not None and self._rank_server.proc.poll() is not None:
            self.ranks = False
            return None
        if self._rank_server is None:
            self._rank_server = ForkServer.start(
                RANK_ROLE,
                self.logs_dir / "rank-fork-server.log",
                node_id=ray.get_runtime_context().get_node_id(),
                env=ray_tag_env(),
                wait=False,
            )
        return self._rank_server.address

    def for_engines(self, kind: EngineKind, record: RunRecord) -> ForkServerAddress | None:
        """Where `kind`'s servers fork from, None where they start as new processes (`engines` False, or a kind
        that does not fork). Starts the engine fork server the first time one is needed and waits until it
        serves; one that does not start (`ForkServerError`) is a note in `record`, and every engine server
        then starts as a new process."""
        if not (self.engines and kind.forks_from_fork_server):
            return None
        if self.engine_address is None:
            try:
                self._engine_server = ForkServer.start(
                    ENGINE_ROLE,
                    self.logs_dir / "fork-server.log",
                    node_id=ray.get_runtime_context().get_node_id(),
                    env=ray_tag_env(),
                )
            except ForkServerError as e:
                record.notes.append(f"engine servers start as new processes: {e}"[:2000])
                self.engines = False
                return None
            self.engine_address = self._engine_server.address
        return self.engine_address

    def stop(self) -> None:
        """Stop the fork servers started here (an owner's `engine_address` stays): the engine one, then the rank
        one, which waits up to 10 s for the ranks Ray was told to kill to end first."""
        try:
            if self._engine_server is not None:
                self._engine_server.stop()
                self._engine_server = self.engine_address = None
        finally:
            if self._rank_server is not None:
                self._rank_server.stop(children_grace_s=10.0)
                self._rank_server = None
