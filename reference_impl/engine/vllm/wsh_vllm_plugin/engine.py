"""`GlooWeightTransferEngine`: vLLM's `nccl` weight-transfer backend over a gloo group, for vLLM on CPU.

vLLM's own backends (`nccl`, `ipc`) need CUDA. This backend is vLLM's `NCCLWeightTransferEngine`
(`vllm/distributed/weight_transfer/nccl_engine.py`) with the communicator swapped, so the trainer speaks
vLLM's protocol and packed format (`packed.py` beside this module) unchanged:

- `init_info` is parsed by vLLM's `NCCLWeightTransferInitInfo` (the body a trainer sends to `nccl`),
  with the TCPStore rendezvous (`master_address`, `master_port`; a `nccl_unique_id_b64` is refused):
  this worker joins the trainer's gloo group on that store as rank `rank_offset` + its global worker
  index (`group.join_transfer_group`), where vLLM's would build a `PyNcclCommunicator`.
- `update_info` is parsed by vLLM's `NCCLWeightTransferUpdateInfo` (names, dtype_names, shapes).
- `start_weight_update` / `finish_weight_update` are vLLM's (`initialize_layerwise_reload` /
  `finalize_layerwise_reload`), plus the two CPU fixes below.
- Receiving: vLLM's packed consumer (`packed_nccl_broadcast_consumer`) runs on CUDA streams and cannot
  run on CPU; this one cuts the same buffers (`packed.buffer_spans` over the declared sizes), receives
  each into a fresh uint8 tensor (the layerwise loader keeps views of it until a layer is complete, maybe
  across calls, so a buffer is never reused), unpacks it with vLLM's own `unpack_tensor` (views, no copy)
  and hands the list to `model.load_weights`, as vLLM's consumer does. Unpacked (`packed: false`): one
  broadcast per tensor, as vLLM's. vLLM's `update_weights` also calls `torch.accelerator.synchronize()`,
  which raises on a host without an accelerator; there is nothing to synchronize on CPU.

What this backend adds to vLLM's, each because of a CPU fact or to keep a failed chunk survivable:
- **Drain, then judge**: the format has no header, so every buffer the declaration implies is received
  before any error is raised (a chunk that fails to load still leaves the trainer's broadcast complete and
  the group in step). An `update_info` that cannot be parsed receives nothing: the trainer must not
  broadcast for it (the harness's sender checks its bodies by the same rules first).
- **Dtype check**: a floating-point tensor whose dtype is not the engine's `--dtype` is refused
  (ValueError naming it); vLLM's loaders would `copy_` and cast silently.
- **Tied lm_head repack** (CPU): `_repack_cpu_embedding_gemms` after finish.
- **Abort after a failed chunk**: `_abort_layerwise_reload` (vLLM 0.32 has none).

Every call logs one INFO line with its bytes and times (receive, unpack, load; start; finalize and
repack), which `profile_sync.py` reads.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLWeightTransferEngine,
    NCCLWeightTransferInitInfo,
    NCCLWeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor
from vllm.logger import init_logger

from wsh_vllm_plugin.group import TransferGroup, join_transfer_group
from wsh_vllm_plugin.packed import VLLM_GLOO, buffer_spans, declared_nbytes
from wsh_vllm_plugin.protocol import DEFAULT_TIMEOUT_S, SENDER_RANK, dtype_name

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

logger = init_logger("vllm.wsh_gloo")  # under "vllm" so that vLLM's log handler prints it


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    """vLLM's NCCL backend over a gloo group on CPU (see the module doc)."""

    supports_draft_weight_update = False

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: TransferGroup | None = None
        self.bytes_received = 0

    def _worker_rank(self, init_info: NCCLWeightTransferInitInfo) -> int:
        # As vLLM's `worker_init_process_group`: unique across data-parallel replicas.
        pc = self.parallel_config
        return init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank

    def init_transfer_engine(self, init_info: NCCLWeightTransferInitInfo) -> None:
        """Record the trainer's packed-format parameters and join its gloo group (blocks until every rank
        joined or `protocol.DEFAULT_TIMEOUT_S` passes).

        Raises:
            ValueError: a `nccl_unique_id_b64` rendezvous, or a worker rank outside `world_size`.
            RuntimeError / DistStoreError: the group did not form within the timeout.
        """
        if init_info.nccl_unique_id_b64:
            raise ValueError(
                f"backend {VLLM_GLOO!r} joins the trainer's TCPStore: send master_address and master_port, not "
                "nccl_unique_id_b64 (an NCCL rendezvous)"
            )
        rank = self._worker_rank(init_info)
        if not 0 < rank < init_info.world_size:
            raise ValueError(
                f"worker rank {rank} does not fit world_size {init_info.world_size} (rank 0 is the trainer)"
            )
        assert init_info.master_address is not None and init_info.master_port is not None  # vLLM's __post_init__
        self.packed = init_info.packed
        self.packed_buffer_size_bytes = init_info.packed_buffer_size_bytes
        self.packed_num_buffers = init_info.packed_num_buffers
        t0 = time.perf_counter()
        self.group = join_transfer_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, DEFAULT_TIMEOUT_S
        )
        logger.info(
            "gloo weight transfer: joined %s:%d as rank %d of %d in %.2fs (packed %s, buffer %d bytes)",
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            time.perf_counter() - t0,
            self.packed,
            self.packed_buffer_size_bytes,
        )

    def start_weight_update(self) -> None:
        """vLLM's: open a layerwise reload of the model (on CPU, MoE layers first learn to repack their experts)."""
        t0 = time.perf_counter()
        self._prepack_cpu_experts_on_reload()
        super().start_weight_update()
        logger.info("gloo weight transfer: start %.3fs", time.perf_counter() - t0)

    def _prepack_cpu_experts_on_reload(self) -> None:
        """Make every unquantized MoE layer repack its experts for vLLM's CPU kernel when it is reloaded.

        `UnquantizedFusedMoEMethod.process_weights_after_loading` runs the experts' own
        `process_weights_after_loading` (on CPU: pad the intermediate size, prepack both weights for the
        grouped GEMM, `experts/cpu_moe.py`) only on its first call, when it builds the kernel; on a weight
        update it copies the reloaded weights in checkpoint layout and stops. The layerwise reload then
        copies them into the prepacked kernel tensors of the first load, whose shapes differ, and the
        chunk fails ("The size of tensor a (128) must match the size of tensor b (96) at non-singleton
        dimension 1", `reload/layerwise.py` `_copy_and_restore_kernel_tensors`). Each such layer's method
        gets an instance-level wrapper (once) that, on a weight update, also runs the experts' step, so
        the reloaded weights reach the kernel in the layout of the first load.
        """
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        for layer in self.model.modules():
            method = getattr(layer, "quant_method", None)
            if isinstance(method, UnquantizedFusedMoEMethod) and not hasattr(method, "_wsh_reload_prepacks"):
                method._wsh_reload_prepacks = True
                method.process_weights_after_loading = _prepacking_on_update(method)

    def finish_weight_update(self) -> None:
        """vLLM's layerwise finalize (process every reloaded layer, restore the untouched ones), then the
        CPU embedding repack. A failing finalize aborts the reload (no layer is left on the meta device)."""
        t0 = time.perf_counter()
        stale = self._tied_embeddings_left_stale()
        try:
            super().finish_weight_update()
        except BaseException:
            self._abort_layerwise_reload()
            raise
        t1 = time.perf_counter()
        self._repack_cpu_embedding_gemms(stale)
        logger.info(
            "gloo weight transfer: finish: finalize %.3fs, embedding repack %.3fs (%d layers)",
            t1 - t0,
            time.perf_counter() - t1,
            len(stale),
        )

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Parse (vLLM's `NCCLWeightTransferUpdateInfo`), receive and load one update; on any failure the
        layerwise reload is aborted (vLLM's worker then ends the session).

        Raises:
            RuntimeError: the group was never initialised.
            ValueError: a malformed update_info (nothing received), a dtype that is not the engine's, or
                whatever vLLM's loader raised (every buffer was received).
        """
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call /init_weight_transfer_engine first")
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            # vLLM's worker ends the session on any exception here; without this the half-reloaded layers
            # stay on the meta device and the next forward kills the engine core.
            self._abort_layerwise_reload()
            raise

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        """Receive every buffer of `update_info` (packed or one tensor each, as the trainer's init said),
        then raise the first failure of its check or load, if any (see the module doc).

        Raises:
            RuntimeError: the group was never initialised, or gloo's (a broadcast that did not come).
            ValueError: an unknown dtype name or lengths that differ (before anything is received); a
                dtype that is not the engine's; vLLM's loader's errors.
        """
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call /init_weight_transfer_engine first")
        names, shapes = update_info.names, update_info.shapes
        sizes = declared_nbytes(names, update_info.dtype_names, shapes)
        dtypes = [getattr(torch, d) for d in update_info.dtype_names]
        spans = (
            buffer_spans(sizes, self.packed_buffer_size_bytes)
            if self.packed
            else [range(i, i + 1) for i in range(len(names))]
        )
        t_recv = t_unpack = t_load = 0.0
        failure: BaseException | None = None
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        for span in spans:
            t0 = time.perf_counter()
            buf = torch.empty(sum(sizes[i] for i in span), dtype=torch.uint8)
            self.group.broadcast(buf, SENDER_RANK)
            t1 = time.perf_counter()
            t_recv += t1 - t0
            self.bytes_received += buf.numel()
            if failure is not None:
                continue  # drain: keep the wire in step, load nothing more
            try:
                pieces = unpack_tensor(
                    buf,
                    [names[i] for i in span],
                    [shapes[i] for i in span],
                    [dtypes[i] for i in span],
                    [sizes[i] for i in span],
                )
                self._check_dtypes([(n, t.dtype) for n, t in pieces])
                t2 = time.perf_counter()
                t_unpack += t2 - t1
                with disable_mtp_completeness_check():
                    self.model.load_weights(pieces)
                t_load += time.perf_counter() - t2
            except BaseException as e:
                failure = e
        logger.info(
            "gloo weight transfer: update: %d tensors in %d buffers, %d bytes; receive %.3fs, unpack %.3fs, load %.3fs",
            len(names),
            len(spans),
            sum(sizes),
            t_recv,
            t_unpack,
            t_load,
        )
        if failure is not None:
            raise failure

    def _check_dtypes(self, named: list[tuple[str, torch.dtype]]) -> None:
        """Refuse floating-point tensors whose dtype is not the engine's (`--dtype`): vLLM's loaders `copy_`
        into the parameter and so cast silently (a trainer sending float32 to a bfloat16 engine moves twice
        the bytes unnoticed). The harness's embedded engine refuses them too.

        Raises:
            ValueError: naming the first mismatching tensor, both dtypes and what to change.
        """
        engine_dtype = self.model_config.dtype
        for name, dtype in named:
            if dtype.is_floating_point and dtype != engine_dtype:
                raise ValueError(
                    f"dtype mismatch for '{name}': sent {dtype_name(dtype)} but the engine's "
                    f"weights are {dtype_name(engine_dtype)}; send the engine's dtype"
                )

    def _cpu_embedding_layers(self) -> list[torch.nn.Module]:
        """The layers whose weight vLLM packs into a CPU GEMM (`UnquantizedEmbeddingMethod` with
        `cpu_linear`: `embed_tokens` and the `lm_head`); none off CPU."""
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return []
        return [
            layer
            for layer in self.model.modules()
            if isinstance(getattr(layer, "quant_method", None), UnquantizedEmbeddingMethod)
            and hasattr(layer, "cpu_linear")
        ]

    def _tied_embeddings_left_stale(self) -> list[torch.nn.Module]:
        """Before finalize: the CPU embedding layers the reload will put back unprocessed (nothing was
        loaded into them by name) although their weight is another embedding layer's that was loaded: a
        tied `lm_head`, whose packed GEMM would keep the old vocab matrix (`_repack_cpu_embedding_gemms`).

        A layer that received nothing has `can_load()` and `load_numel <= 0` at this point; a layer the
        reload already processed has been reset (`can_load()` false) and was repacked by vLLM.
        """
        from vllm.model_executor.model_loader.reload import layerwise

        layers = self._cpu_embedding_layers()
        untouched = [
            layer
            for layer in layers
            if layerwise.get_layerwise_info(layer).can_load() and layerwise.get_layerwise_info(layer).load_numel <= 0
        ]
        loaded = [layer for layer in layers if all(layer is not u for u in untouched)]

        def storage(layer: torch.nn.Module) -> int:
            # the weight each layer will hold after finalize: its kernel tensor when it is put back
            info = layerwise.get_layerwise_info(layer)
            kernel = info.kernel_tensors[0].get("weight") if info.kernel_tensors is not None else None
            weight = kernel if kernel is not None else layer.weight
            return weight.untyped_storage().data_ptr()

        return [u for u in untouched if any(storage(u) == storage(other) for other in loaded)]

    def _repack_cpu_embedding_gemms(self, layers: list[torch.nn.Module] | None = None) -> None:
        """Rebuild the CPU GEMM of embedding-method layers (`layers`, default every one) from their weight.

        On CPU, `UnquantizedEmbeddingMethod.process_weights_after_loading` packs the weight into a
        closure (`layer.cpu_linear`, oneDNN / sgl) and keeps the weight itself. A tied `lm_head` is never
        loaded by name (its weight is `embed_tokens`'s), so the layerwise reload counts it as "no weights
        loaded", puts its old tensors back and never repacks it: its weight holds the new values while
        the logits still come from the packing of the old ones (seen: log-probs stayed near uniform after
        syncing over dummy weights). Repacking such a layer after the session fixes that; it costs one
        repack of the vocab matrix per sync (`embed_tokens` itself was repacked by vLLM when it loaded).
        """
        for layer in self._cpu_embedding_layers() if layers is None else layers:
            layer.quant_method.process_weights_after_loading(layer)

    def _abort_layerwise_reload(self) -> None:
        """Undo an open layerwise reload: every layer still waiting for weights gets its kernel tensors
        (the values before this session) back, and the reload state is cleared.

        Layers that were complete before the failing chunk keep their new values, so the model may hold a
        mix of old and new weights afterwards, but it stays usable (a later session can fix it). vLLM
        0.32 has no such abort; this mirrors what `finalize_layerwise_processing` does for a layer that
        received nothing.
        """
        from vllm.model_executor.model_loader.reload import layerwise

        for layer in self.model.modules():
            info = layerwise.get_layerwise_info(layer)
            if not info.can_load():
                continue
            if info.kernel_tensors is not None:
                layerwise._place_kernel_tensors(layer, info)
            info.reset()
        if hasattr(self.model, "_original_do_torchao_reload"):
            self.model._do_torchao_reload = self.model._original_do_torchao_reload
        layerwise.LOADING_LAYERS.clear()
        self._repack_cpu_embedding_gemms()
        logger.warning("gloo weight transfer: update failed; layerwise reload aborted (pending layers restored)")

    def shutdown(self) -> None:
        """Drop the group (gloo has no explicit destroy; the trainer's store outlives it)."""
        self.group = None


def _prepacking_on_update(method: Any) -> Any:
    """`method.process_weights_after_loading` (an unquantized MoE method), followed on a weight update (its
    kernel already built) by the experts' own `process_weights_after_loading` (see
    `GlooWeightTransferEngine._prepack_cpu_experts_on_reload`)."""
    original = method.process_weights_after_loading

    def process_weights_after_loading(layer: torch.nn.Module) -> None:
        is_update = method.moe_kernel is not None
        original(layer)
        if is_update:
            method.moe_kernel.fused_experts.process_weights_after_loading(layer)

    return process_weights_after_loading
