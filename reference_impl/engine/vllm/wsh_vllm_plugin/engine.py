"""`GlooWeightTransferEngine`: vLLM's worker-side weight-transfer backend on CPU, over a gloo group.

It speaks the weight-sync harness's protocol and wire format, defined once in `protocol.py` beside
this module (the trainer's sender and the embedded engine import the same file): `init_info` is a
`protocol.InitInfo` with backend "gloo", each `update_info` a `protocol.UpdateInfo` without handle,
and each chunk's bytes come by `protocol.TransferGroup.receive_chunk` (an int64 byte-count header, then
the packed payload, broadcast from `update_info.src`). This worker joins the group as rank
`rank_offset` + its global worker index (DP/TP/PP), in a group of `world_size` ranks.

Receive first, check later: `update_weights` always takes both broadcasts before it validates
anything, so a bad `update_info` gives an error answer instead of leaving the trainer's broadcast hung
until the gloo timeout. (A call that vLLM's worker refuses before it reaches this engine, e.g.
/update_weights without /start_weight_update, still leaves the trainer's broadcast waiting: that check
is vLLM's, not ours.)

Loading follows vLLM's NCCL backend and `model_runner.reload_weights(..., is_checkpoint_format=True)`:
`start_weight_update` runs `initialize_layerwise_reload(model)`, every chunk goes through
`model.load_weights(...)` (checkpoint names and layouts; vLLM fuses q/k/v and gate/up itself), and
`finish_weight_update` runs `finalize_layerwise_reload(model, model_config)`. This is what makes it work
on CPU in fp32, where vLLM has prepacked the linear weights (a bare `load_weights` fails there). The
layerwise loader buffers a layer's pieces until the layer is complete, possibly across chunks, so the
unpacked tensors are views into a fresh per-chunk buffer that is never reused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from wsh_vllm_plugin.protocol import (
    GLOO,
    SENDER_RANK,
    InitInfo,
    TransferGroup,
    UpdateInfo,
    dtype_from_name,
    dtype_name,
    join_transfer_group,
    unpack,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

logger = init_logger("vllm.wsh_gloo")  # under "vllm" so that vLLM's log handler prints it


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(InitInfo, WeightTransferInitInfo):
    """`protocol.InitInfo` as vLLM's typed init info (`WeightTransferEngine.parse_init_info` builds it
    from the request's dict by keyword). Only backend "gloo" is accepted, with its fields checked.

    Raises:
        ValueError: another backend, or a gloo rule broken (`protocol.ProtocolError`).
    """

    def __post_init__(self) -> None:
        if self.backend != GLOO:
            raise ValueError(f"init_info backend {self.backend!r}: this engine was started with backend {GLOO!r}")
        self.check()


@dataclass(kw_only=True)
class GlooWeightTransferUpdateInfo(UpdateInfo, WeightTransferUpdateInfo):
    """`protocol.UpdateInfo` as vLLM's typed update info (`parse_update_info`): packed, no handle.

    Raises:
        ValueError: list lengths differ (`protocol.ProtocolError`), packed is false, or a handle is given
            (backend "gloo" receives by broadcast).
    """

    def __post_init__(self) -> None:
        self.check()
        if not self.packed:
            raise ValueError(f"backend {GLOO!r} receives packed chunks only (update_info packed must be true)")
        if self.handle is not None:
            raise ValueError(
                f"update_info carries a {self.handle.get('kind', '?')!r} handle but the transfer backend is "
                f"{GLOO!r}; send the chunk by broadcast"
            )


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """CPU weight transfer from the harness's trainer over gloo (see the module doc for the format)."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
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
        self.chunks_received = 0
        self.bytes_received = 0

    def _worker_rank(self, init_info: GlooWeightTransferInitInfo) -> int:
        pc = self.parallel_config
        return init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        """Join the trainer's gloo group (blocks until every rank has joined or `timeout_s` passes)."""
        rank = self._worker_rank(init_info)
        if rank >= init_info.world_size:
            raise ValueError(f"worker rank {rank} does not fit world_size {init_info.world_size}")
        assert init_info.master_address is not None and init_info.master_port is not None  # checked at parse
        t0 = time.perf_counter()
        self.group = join_transfer_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s
        )
        logger.info(
            "gloo weight transfer: joined %s:%d as rank %d of %d in %.2fs",
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            time.perf_counter() - t0,
        )

    def start_weight_update(self) -> None:
        """Open a layerwise reload of the model (checkpoint-format weights follow)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._prepack_cpu_experts_on_reload()
        initialize_layerwise_reload(self.model)

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
        """Process every reloaded layer (repack) and restore the layers no chunk touched."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            finalize_layerwise_reload(self.model, self.model_config)
        except BaseException:
            self._abort_layerwise_reload()  # never leave layers on the meta device
            raise
        self._repack_cpu_embedding_gemms()

    def _repack_cpu_embedding_gemms(self) -> None:
        """Rebuild the CPU GEMM of every embedding-method layer (the tied `lm_head`) from its weight.

        On CPU, `UnquantizedEmbeddingMethod.process_weights_after_loading` packs the weight into a
        closure (`layer.cpu_linear`, oneDNN / sgl) and keeps the weight itself. A tied `lm_head` is never
        loaded by name (its weight is `embed_tokens`'s), so the layerwise reload counts it as "no weights
        loaded", puts its old tensors back and never repacks it: its weight holds the new values while
        the logits still come from the packing of the old ones (seen: log-probs stayed near uniform after
        syncing over dummy weights). Repacking every such layer after each session fixes that; it costs
        one repack of the vocab matrix per sync.
        """
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        for layer in self.model.modules():
            method = getattr(layer, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod) and hasattr(layer, "cpu_linear"):
                method.process_weights_after_loading(layer)

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
        logger.warning("gloo weight transfer: chunk failed; layerwise reload aborted (pending layers restored)")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one chunk FIRST (so the trainer's broadcast never hangs on a bad body), then check,
        unpack and load it.

        Raises:
            RuntimeError: the group was never initialised (nothing can be received then).
            ValueError: a malformed update_info, an unknown dtype, or a byte count that does not match
                the declared dtypes/shapes; the chunk was received and dropped.
        """
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call /init_weight_transfer_engine first")
        src = update_info.get("src", SENDER_RANK) if isinstance(update_info, dict) else SENDER_RANK
        src = src if isinstance(src, int) and not isinstance(src, bool) else SENDER_RANK
        t0 = time.perf_counter()
        payload = self.group.receive_chunk(src)
        t1 = time.perf_counter()
        try:
            info = self.parse_update_info(update_info)
            self._load(info, payload)
        except BaseException:
            # vLLM's worker ends the session on any exception here; without this the half-reloaded layers
            # stay on the meta device and the next forward kills the engine core.
            self._abort_layerwise_reload()
            raise
        self.chunks_received += 1
        self.bytes_received += payload.numel()
        logger.debug(
            "gloo chunk %s: %d tensors, %d bytes, receive %.3fs, load %.3fs",
            info.chunk_index,
            len(info.names),
            payload.numel(),
            t1 - t0,
            time.perf_counter() - t1,
        )

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        """Receive and load one chunk whose update_info is already parsed (vLLM's abstract entry)."""
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call /init_weight_transfer_engine first")
        self._load(update_info, self.group.receive_chunk(update_info.src))

    def _load(self, info: GlooWeightTransferUpdateInfo, payload: torch.Tensor) -> None:
        dtypes = [dtype_from_name(d) for d in info.dtype_names]
        tensors = unpack(payload, dtypes, info.shapes)
        self._check_dtypes(info.names, dtypes)
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            self.model.load_weights(list(zip(info.names, tensors, strict=True)))

    def _check_dtypes(self, names: list[str], dtypes: list[torch.dtype]) -> None:
        """Refuse floating-point tensors whose dtype is not the engine's (`--dtype`).

        vLLM's loaders `copy_` into the parameter and so cast silently; a trainer that sends float32 to
        a bfloat16 engine (or the reverse) then moves twice the bytes, or loses precision, unnoticed. This
        backend makes it an error, as the harness's embedded engine does.

        Raises:
            ValueError: naming the first mismatching tensor, both dtypes and what to change.
        """
        engine_dtype = self.model_config.dtype
        for name, dtype in zip(names, dtypes, strict=True):
            if dtype.is_floating_point and dtype != engine_dtype:
                raise ValueError(
                    f"dtype mismatch for '{name}': sent {dtype_name(dtype)} but the engine's "
                    f"weights are {dtype_name(engine_dtype)}; send the engine's dtype"
                )

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
