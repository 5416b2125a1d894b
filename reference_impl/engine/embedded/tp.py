"""The embedded engine with tensor parallelism: TP ranks that each receive every chunk and keep their shard.

What vLLM does with `--tensor-parallel-size t` and a broadcast transfer backend, and what this mirrors:
each of its t workers joins the transfer group (as `rank_offset + worker rank`,
`nccl_common.py` / `wsh_vllm_plugin/engine.py`), takes every chunk's broadcast whole (the chunk carries
full checkpoint tensors, `update_info` has no TP layout), and its weight loader cuts the worker's own piece
out of each tensor into its shard of the vLLM parameter (`QKVParallelLinear.weight_loader` and friends,
`models.vllm_tp`). So the trainer needs to know nothing of the engine's TP, and a wrong piece is a bug of
the engine's loader, not of the wire. (Sending each rank only its shard would move fewer bytes, but vLLM's
protocol has no field for an engine's layout.)

`TpRanks` holds t such ranks in the embedded engine's process: each joins the group with its own gloo
membership, receives every chunk concurrently with the others, and keeps its shard of every vLLM
parameter (its `store`, vLLM names and layouts, zero vocabulary padding included). The transformers model
the engine serves is rebuilt from the ranks' shards after every chunk (`assembled`: the inverse of the
pieces), so what the engine answers with is what its ranks hold. The ranks' shards are reported per rank
(`checksums`, in vLLM names) for the harness to compare with vLLM's partition of the expected state, which
it computes on its own: a rank that kept the wrong piece is found even when the rebuilt model is right.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from wsh_vllm_plugin.group import TransferGroup, join_transfer_group
from wsh_vllm_plugin.protocol import InitInfo, dtype_from_name, pack, unpack

from reference_impl.checksum import tensor_checksum
from reference_impl.engine.embedded.loader import EngineLoader
from reference_impl.engine.embedded.receive import ChunkApplier, ChunkRejected
from reference_impl.models import vllm_tp
from reference_impl.models.vllm_names import VllmTarget


class TpRanks:
    """`tp` TP ranks over one engine's loader (see the module doc).

    Args:
        loader: the engine's loader (its shards say where each checkpoint tensor loads in vLLM).
        tp: ranks (vLLM's `--tensor-parallel-size`).
        config: the checkpoint's `config.json` dict (heads, KV heads, head_dim, intermediate size, vocab).

    Raises:
        KeyError: the model family has no vLLM TP layout here (`models.vllm_tp.TP_RULES`).
        ValueError: `tp` does not divide what vLLM splits.
    """

    def __init__(self, loader: EngineLoader, tp: int, config: dict[str, Any]) -> None:
        if not vllm_tp.has_tp_rules(loader.model_type):
            raise KeyError(f"no vLLM TP layout for model_type {loader.model_type!r}: {sorted(vllm_tp.TP_RULES)}")
        self.loader, self.tp = loader, tp
        self.dims = vllm_tp.TpDims.from_config(config)
        self.groups: list[TransferGroup] = []
        self.payloads: list[torch.Tensor | None] = [None] * tp
        self.stores: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
        self.pool = ThreadPoolExecutor(max_workers=tp, thread_name_prefix="tp-rank")
        names = list(loader.shards)  # every rank starts with its shard of the engine's current weights
        self._keep([[loader.view(loader.shards[n]).detach().clone() for n in names]] * tp, names)

    # ------------------------------------------------------------------ the transfer group

    def join(self, info: InitInfo) -> TpRanks:
        """Every rank joins the transfer group as `info.rank_offset + rank`, all at once (each blocks until
        the whole group arrived). Returns self, which then receives chunks as one group member would.

        Raises:
            ValueError: the ranks do not fit the group (`rank_offset + tp > world_size`), as vLLM's backend
                refuses a worker rank >= world_size.
            RuntimeError / DistStoreError: the group did not form within `info.timeout_s` seconds.
        """
        assert info.master_address is not None and info.master_port is not None  # checked by the caller
        if info.rank_offset + self.tp > info.world_size:
            raise ValueError(
                f"TP ranks {info.rank_offset}..{info.rank_offset + self.tp - 1} do not fit world_size {info.world_size}"
            )

        def one(rank: int) -> TransferGroup:
            return join_transfer_group(
                info.master_address,
                info.master_port,
                info.rank_offset + rank,
                info.world_size,
                info.timeout_s,
                backend=info.backend,
                reuse_receive_buffer=True,  # each rank copies its pieces before the next chunk is received
            )

        futures = [self.pool.submit(one, r) for r in range(self.tp)]
        self.groups = [f.result() for f in futures]
        return self

    @property
    def rank(self) -> int:
        """The first TP rank's rank in the transfer group (`rank_offset`)."""
        return self.groups[0].rank

    @property
    def ranks(self) -> set[int]:
        """Every TP rank's rank in the transfer group."""
        return {g.rank for g in self.groups}

    @property
    def world_size(self) -> int:
        """Ranks in the transfer group (the sender and every engine worker)."""
        return self.groups[0].world_size

    def receive_chunk(self, src: int) -> torch.Tensor:
        """Every rank receives the chunk broadcast by `src` at once; returns rank 0's bytes (each rank keeps
        its own in `payloads`). Raises RuntimeError from gloo when `src` does not send in time."""
        futures = [self.pool.submit(g.receive_chunk, src) for g in self.groups]
        self.payloads = [f.result() for f in futures]
        first = self.payloads[0]
        assert first is not None
        return first

    # ------------------------------------------------------------------ shards

    def target(self, hf_name: str) -> tuple[VllmTarget, vllm_tp.PartitionKind]:
        """Where `hf_name` loads in vLLM and how that parameter is partitioned."""
        target = self.loader.shards[hf_name].target
        return target, vllm_tp.partition_of(self.loader.model_type, target.name)

    def piece(self, hf_name: str, shape: Sequence[int], rank: int) -> vllm_tp.Piece:
        """Rank `rank`'s piece of checkpoint tensor `hf_name` of `shape` (`models.vllm_tp.pieces`)."""
        target, kind = self.target(hf_name)
        return vllm_tp.pieces(kind, target.shard, tuple(shape), rank, self.tp, self.dims)

    def _keep(self, per_rank: Sequence[Sequence[torch.Tensor]], names: Sequence[str]) -> None:
        """Rank r copies its piece of each `per_rank[r][i]` (checkpoint tensor `names[i]`) into its shard."""
        with torch.no_grad():
            for rank, tensors in enumerate(per_rank):
                store = self.stores[rank]
                for name, full in zip(names, tensors, strict=True):
                    p = self.piece(name, full.shape, rank)
                    vllm_name = self.target(name)[0].name
                    if vllm_name not in store:
                        store[vllm_name] = torch.zeros(p.shard_shape, dtype=full.dtype)
                    dst = store[vllm_name].narrow(p.dim, p.dst_offset, p.size)
                    dst.copy_(full.narrow(p.dim, p.src_start, p.size))
                    if self.target(name)[1] == "vocab":  # rows past the real vocabulary stay zero
                        store[vllm_name].narrow(0, p.size, p.shard_shape[0] - p.size).zero_()

    def keep_received(self, names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]) -> None:
        """Every rank unpacks the chunk it received and keeps its pieces.

        Raises:
            ValueError: a rank received a byte count that does not match the declared dtypes/shapes (nothing
                is kept then, by any rank).
        """
        dtypes = [dtype_from_name(d) for d in dtype_names]
        per_rank = []
        for payload in self.payloads:
            if payload is None:
                raise ValueError("a TP rank received nothing for this chunk")
            per_rank.append(unpack(payload, dtypes, shapes))
        self._keep(per_rank, names)

    def assembled(self, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The checkpoint tensors `names` (of `shapes`) rebuilt from the ranks' shards: every rank's piece put
        back where it came from (a KV head held by several ranks comes from each of them in turn)."""
        out = []
        for name, shape in zip(names, shapes, strict=True):
            vllm_name = self.target(name)[0].name
            full = torch.empty(tuple(shape), dtype=self.stores[0][vllm_name].dtype)
            for rank in range(self.tp):
                p = self.piece(name, shape, rank)
                held = self.stores[rank][vllm_name].narrow(p.dim, p.dst_offset, p.size)
                full.narrow(p.dim, p.src_start, p.size).copy_(held)
            out.append(full)
        return out

    def checksums(self) -> dict[str, dict[str, str]]:
        """TP rank (as a string) -> vLLM parameter name -> `tensor_checksum` of the rank's shard."""
        return {str(r): {n: tensor_checksum(t) for n, t in store.items()} for r, store in enumerate(self.stores)}


class TpChunkApplier(ChunkApplier):
    """`ChunkApplier` of an engine with TP ranks: the chunk is checked as one engine checks it, every rank
    keeps its pieces of what it received, and the served model takes the tensors rebuilt from the ranks'
    shards (so it holds what the ranks hold)."""

    def __init__(self, loader: EngineLoader, ranks: TpRanks) -> None:
        super().__init__(loader)
        self.ranks = ranks

    def apply(
        self,
        chunk: str,
        names: Sequence[str],
        dtype_names: Sequence[str],
        shapes: Sequence[Sequence[int]],
        payload: torch.Tensor,
    ) -> None:
        """Validate as `ChunkApplier.apply` does (a refused chunk is refused by it, with its reasons, before
        any rank keeps anything), then every rank keeps its pieces, then the rebuilt tensors are loaded.

        Raises:
            ChunkRejected: as `ChunkApplier.apply`.
        """
        declared = self.check(chunk, names, dtype_names, shapes)  # refuses it with the engine's reasons
        for rank, got in enumerate(self.ranks.payloads):
            if got is None or got.numel() != declared:
                if rank == 0:
                    super().apply(chunk, names, dtype_names, shapes, payload)  # refuses it with the engine's reasons
                held = "nothing" if got is None else f"{got.numel()} bytes"
                reason = f"{chunk}: TP rank {rank} received {held} but the declared dtypes/shapes need {declared}"
                raise ChunkRejected(reason, dict.fromkeys(names, reason), dict.fromkeys(names, "bytes"))
        self.ranks.keep_received(names, dtype_names, shapes)
        rebuilt = self.ranks.assembled(names, shapes)
        super().apply(chunk, names, dtype_names, shapes, pack(rebuilt))
