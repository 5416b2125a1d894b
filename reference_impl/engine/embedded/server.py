"""The embedded rollout engine: vLLM's RLHF weight-update routes over a transformers model.

Run: `python -m reference_impl.engine.embedded --checkpoint DIR --seed N --host 127.0.0.1
--port 0 --port-file FILE [--fault MODULE:FUNCTION]`. With port 0 it binds a free port and writes the port
it serves on to FILE (atomically) once it accepts requests. `--fault MODULE:FUNCTION` loads a fault hook
at start (the harness's mutation tests: `harness.faults.engine`): the function is called once, before
the app is built, and may replace what runs at the engine's seams (`reference_impl.seams`); a hook
that cannot be loaded exits at startup.

Request bodies are the protocol's (`wsh_vllm_plugin.protocol`: `InitInfo`, `UpdateInfo`, the handle
layouts), read by their `from_json` (exact JSON types, ranges, no unknown field; a name with a control
character or twice in one chunk, a negative dimension: refused by field). Every body refuses unknown fields.

Routes and bodies follow vLLM's (`vllm/entrypoints/rl/online/api_router.py`; older releases
`vllm/entrypoints/serve/dev/rlhf/api_router.py`), with plain-data answers the harness records:

- POST /init_weight_transfer_engine `{"init_info": {"backend": "gloo", "master_address", "master_port",
  "rank_offset", "world_size", "timeout_s"}}` -> joins the transfer group as rank `rank_offset` (blocks until the
  trainer joins) -> `{"ok": true, "backend": "gloo", "rank": r, "world_size": w}`; backend "nccl" (GPU; a 400
  where the engine has no CUDA) joins the same group over NCCL. Colocate:
  `{"init_info": {"backend": "shm"}}` (CPU) or `{"init_info": {"backend": "cuda_ipc"}}` (GPU; a 400 where
  the engine has no CUDA) -> nothing to join (vLLM's IPC init info is empty too) -> `{"ok": true,
  "backend": b}`. A later init replaces the backend; a failed gloo join keeps the previous one.
- POST /start_weight_update `{}` or `{"weight_version": v}` -> opens a session, zeroes the update
  counts -> `{"ok": true}`; 400 when one is open.
- POST /update_weights `{"update_info": {"names", "dtype_names", "shapes", "packed": true, "src": 0,
  "chunk_index", "handle"}}` -> with no open session, a 400 (kind "session") before anything is received, as
  vLLM's worker refuses it before its transfer backend runs (a sender must not broadcast then);
  otherwise receives the chunk from the group FIRST (so a bad body never leaves the trainer's broadcast
  hanging: also an update_info the protocol refuses is received and dropped first, as vLLM's gloo plugin
  does; only a body that is no object with an object `update_info` is refused before, by both), then
  checks, unpacks and loads it -> `{"ok": true, "chunk_index", "received_bytes",
  "load_s", "loaded"}`. With backend shm / cuda_ipc, update_info's `"handle"` is `{"kind": "shm",
  "name", "nbytes"}` / `{"kind": "cuda_ipc", "ipc", "nbytes", "device_uuid"}`
  (opened by `reference_impl.transport.handles`) and the engine reads the chunk from it (no broadcast; views over
  the shared buffer, copied by the load, dropped before the handle is closed). The handle is checked
  (`handles.check_handle`) only after the session and the chunk's names, shapes and dtypes, and before
  anything is mapped: its nbytes must be the declared dtypes x shapes, an shm segment must be named by the
  producer (`protocol.SHM_NAME_PREFIX`), a cuda_ipc pickle may hold only what torch's `reduce_tensor`
  makes. A missing, malformed, foreign or unopenable handle is a 400 naming the chunk and the field (kind
  "bytes"); so is a handle under backend gloo (nothing is broadcast-received then: a sender that passes
  handles does not broadcast).
- POST /finish_weight_update `{"weight_version": v}` -> `{"weight_version", "update_counts": {shard:
  n for every shard}, "load_s"}`. A shard is one checkpoint tensor, keyed by its vLLM target string
  (`vllm_name` or `vllm_name[shard]`, e.g. `model.layers.0.mlp.experts.routed_experts.w13_weight[3:w1]`); a full sync
  counts every shard exactly once.
- POST /weight_checker `{"action": "checksum" | "shards" | "reset" | "compare", "baseline"?}`: "checksum"
  -> `{"checksums": {checkpoint_name: checksum}}` over each shard's view of the engine's parameters in the
  checkpoint's layout (equal to the safetensors tensors' after a full sync); "shards" -> the shard strings;
  "compare" compares the checksums with `baseline` (checkpoint names).
- POST /v1/completions `{"prompt": [token ids], "max_tokens": 0|1, "temperature", "prompt_logprobs",
  "logprobs", "multi_modal_data": {"image": data URL}}` -> vLLM's `CompletionResponse` with
  `choices[0].prompt_logprobs` (`completions`, which documents the shapes and where we differ from
  vLLM: temperature applied to prompt log-probs). The forward runs under the same lock as chunk loads
  (never over a half-applied chunk) and is refused with a 409 (kind "session") while an update session
  is open or the engine is paused.
- GET /weight_info -> `{"weight_version": "<v>"}` (vLLM's route): the version committed by the last finish.
- POST /reset_prefix_cache -> `{"success": true}`, POST /reset_encoder_cache -> `{"success": true}`
  (vLLM's routes): clear the prefix cache and the vision-encoder cache (`caches`); nothing else clears
  them, a weight update included, as in vLLM 0.32.
- POST /transfer_probe `{"sizes": [bytes, ...]}` (the harness's own route, not vLLM's: the bare transfer a
  scenario's bound is measured with, `reference_impl.transport.bound`) -> under backend gloo / nccl, takes
  one bare broadcast of each size from the sender (no header, no session, nothing unpacked or loaded: the
  bytes are dropped) -> `{"ok": true, "received_bytes": n}`; a 400 (kind "session") under a handle backend or
  while an update session is open (a probe never runs inside an update).
- GET /health, GET /get_world_size, GET /is_paused, POST /pause, POST /resume.

Every 4xx body is `{"detail": {"error": sentence, "rejected": {hf_name: reason}, "kinds": {hf_name:
kind}}}` with kind "name" | "shape" | "dtype" | "bytes" | "session" ("request" for malformed bodies,
keyed by field). Any other exception is a 500 whose body carries the traceback; the server keeps serving.

Differences from vLLM, on purpose: a rejected chunk leaves the session open (nothing of it was
loaded; the finish counts show the gap) where vLLM's worker drops the session on any exception; a
tied `lm_head.weight` and a dtype mismatch are errors where vLLM skips / casts silently (the harness's
vLLM plugin refuses a dtype mismatch too); errors are 4xx with `{"detail": {"rejected", "kinds"}}`
where vLLM answers 500 with the worker's exception text ("Call to collective_rpc method failed ...");
answers carry counts and load times where vLLM's carry only `{"message"}`. Each engine kind's adapter
parses its own answers into `Rejection`s (`answers.py` here, `engine/vllm/answers.py` for vLLM), so the
checks read the same data from both (tests/vllm_engine/test_bad_inputs.py sends the same bad inputs to
both engines and asserts the same verdicts).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch
from fastapi import FastAPI, HTTPException
from wsh_vllm_plugin.group import TransferGroup, join_transfer_group
from wsh_vllm_plugin.protocol import (
    CUDA_IPC,
    GROUP_BACKENDS,
    HANDLE_KINDS,
    NCCL,
    SENDER_RANK,
    InitInfo,
    UpdateInfo,
)

from reference_impl.engine.embedded import bodies, receive
from reference_impl.engine.embedded.bodies import (
    CheckerRequest,
    FinishRequest,
    InitRequest,
    ProbeRequest,
    StartRequest,
    UpdateRequest,
)
from reference_impl.engine.embedded.completions import CompletionEngine, CompletionError, CompletionRequest
from reference_impl.engine.embedded.loader import EngineLoader
from reference_impl.engine.embedded.tp import TpChunkApplier, TpRanks


class EngineState:
    """Mutable state of one engine: transfer backend and group, update session, version, paused flag. With
    `tp` > 1 the engine has TP ranks that each receive every chunk and keep their shard (`tp.TpRanks`)."""

    def __init__(self, loader: EngineLoader, tp: int = 1, config: dict[str, Any] | None = None) -> None:
        self.loader = loader
        self.tp = tp
        self.ranks = TpRanks(loader, tp, config or loader.model.config.to_dict()) if tp > 1 else None
        self.applier = receive.ChunkApplier(loader) if self.ranks is None else TpChunkApplier(loader, self.ranks)
        self.backend: str | None = None  # set by a successful /init_weight_transfer_engine
        self.group: TransferGroup | TpRanks | None = None
        self.session_open = False
        self.weight_version = 0
        self.session_load_s = 0.0
        self.paused = False
        self.lock = threading.Lock()  # one chunk received + loaded at a time, in arrival order
        self.completer: CompletionEngine  # set by `create_app`

    def close(self) -> None:
        """Release what this state holds (`restart.RestartableApp` replaced the app it serves): the TP ranks'
        threads, the transfer group, the model and its caches. The app's handlers may outlive the app
        (FastAPI keeps each endpoint function in a module-level cache of its dependency analysis, and the
        handlers close over this state), so the weights must not hang on this object."""
        if self.ranks is not None:
            self.ranks.pool.shutdown(wait=False)
        self.group = self.ranks = None
        del self.loader, self.applier, self.completer

    def open_session(self, version: int | None) -> None:
        """What /start_weight_update does once no session is open: open one and zero its load time and update
        counts. `version` (the start's `weight_version`, None when it named none) is read but, as in vLLM, only
        a finish commits one: until then /weight_info and completions report the version before. A seam
        (`reference_impl.seams`)."""
        self.session_open = True
        self.session_load_s = 0.0
        self.loader.reset_counts()

    def serving_refusal(self) -> str | None:
        """Why this engine refuses to serve a completion now (None: it serves one): an open update session
        (its weights may be half-updated) or a pause. A seam (`reference_impl.seams`)."""
        if self.session_open:
            return "an update session is open"
        return "the engine is paused" if self.paused else None

    def commit_version(self, version: int) -> None:
        """The weights now in place are `version` (what /finish_weight_update commits, and what
        /weight_info and completions report). A seam (`reference_impl.seams`)."""
        self.weight_version = version


def create_app(
    loader: EngineLoader,
    config: dict[str, Any] | None = None,
    served_name: str = "wsh-embedded",
    tp: int = 1,
) -> FastAPI:
    """The FastAPI app over `loader`. Handlers are sync so FastAPI runs them in its threadpool.

    `config`: the checkpoint's config.json dict (image processing of VL models; default: the model's
    config as a dict). `served_name`: the model name /v1/completions answers. `tp`: the engine's TP ranks
    in the transfer group (`tp.TpRanks`; vLLM's `--tensor-parallel-size`).
    """
    app = FastAPI(title="wsh embedded engine")
    st = EngineState(loader, tp, config)
    app.state.engine = st
    st.completer = CompletionEngine(
        loader.model, config if config is not None else loader.model.config.to_dict(), served_name
    )

    bodies.install_error_handlers(app)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok"}

    @app.get("/weight_info")
    def weight_info() -> dict[str, str]:
        """vLLM's `GET /weight_info`: the committed weight version, as a string."""
        return {"weight_version": str(st.weight_version)}

    @app.post("/reset_prefix_cache")
    def reset_prefix_cache() -> dict[str, bool]:
        """vLLM's `POST /reset_prefix_cache`: drop every cached prompt prefix (`caches.PrefixCache`)."""
        with st.lock:
            st.completer.prefix_cache.reset()
        return {"success": True}

    @app.post("/reset_encoder_cache")
    def reset_encoder_cache() -> dict[str, bool]:
        """vLLM's `POST /reset_encoder_cache`: drop every cached image's features (`caches.EncoderCache`)."""
        with st.lock:
            st.completer.encoder_cache.reset()
        return {"success": True}

    @app.get("/get_world_size")
    def get_world_size() -> dict[str, int]:
        return {"world_size": st.tp}

    @app.post("/pause")
    def pause() -> dict[str, str]:
        st.paused = True
        return {"status": "paused"}

    @app.post("/resume")
    def resume() -> dict[str, str]:
        st.paused = False
        return {"status": "resumed"}

    @app.get("/is_paused")
    def is_paused() -> dict[str, bool]:
        return {"is_paused": st.paused}

    @app.post("/init_weight_transfer_engine")
    def init_weight_transfer_engine(req: InitRequest) -> dict[str, Any]:
        route = "/init_weight_transfer_engine"
        info = bodies.read(InitInfo, req.init_info, route, "init_info")
        cpu_instead = {CUDA_IPC: "shm", NCCL: "gloo"}  # the CPU backend of each CUDA-only one
        if info.backend in cpu_instead and not torch.cuda.is_available():
            raise bodies.request_error(
                route,
                "body.init_info.backend",
                f"backend '{info.backend}' needs CUDA in the engine process (torch.cuda.is_available() is "
                f"False); use backend '{cpu_instead[info.backend]}' on CPU",
            )
        if info.backend in HANDLE_KINDS:
            with st.lock:
                st.backend = info.backend
            return {"ok": True, "backend": info.backend}
        assert info.master_address is not None and info.master_port is not None
        with st.lock:
            if st.ranks is not None:  # every TP rank joins, as rank_offset + its rank
                st.group = st.ranks.join(info)
            else:
                st.group = join_transfer_group(
                    info.master_address,
                    info.master_port,
                    rank=info.rank_offset,
                    world_size=info.world_size,
                    timeout_s=info.timeout_s,
                    backend=info.backend,
                    reuse_receive_buffer=True,  # the loader copies every chunk before the next is received
                )
            st.backend = info.backend
        return {"ok": True, "backend": info.backend, "rank": info.rank_offset, "world_size": info.world_size}

    @app.post("/start_weight_update")
    def start_weight_update(req: StartRequest | None = None) -> dict[str, Any]:
        with st.lock:
            if st.session_open:
                why = "start_weight_update called while an update session is open; POST /finish_weight_update first"
                raise bodies.http_error(400, why, {"/start_weight_update": why}, {"/start_weight_update": "session"})
            st.open_session(req.weight_version if req is not None else None)
        return {"ok": True}

    @app.post("/update_weights")
    def update_weights(req: UpdateRequest) -> dict[str, Any]:
        try:
            info = bodies.read(UpdateInfo, req.update_info, "/update_weights", "update_info")
        except HTTPException:
            with st.lock:
                _drain(req.update_info)
            raise
        chunk = f"chunk {info.chunk_index}" if info.chunk_index is not None else "this chunk"
        with st.lock:
            if st.backend is None or (st.backend in GROUP_BACKENDS and st.group is None):
                raise bodies.http_error(
                    400,
                    f"{chunk}: no transfer group or handle backend; POST /init_weight_transfer_engine before "
                    "/update_weights",
                    dict.fromkeys(info.names, "no transfer group"),
                    dict.fromkeys(info.names, "session"),
                )
            if not info.packed:
                _drain(req.update_info)
                raise bodies.http_error(
                    400,
                    f"{chunk}: packed=false is not supported by the embedded engine; send packed chunks",
                    dict.fromkeys(info.names, "unpacked transfer"),
                    dict.fromkeys(info.names, "bytes"),
                )
            try:
                if st.backend in GROUP_BACKENDS:
                    received, load_s = _receive_broadcast(info, chunk)
                else:
                    received, load_s = _receive_handle(info, chunk)
            except receive.ChunkRejected as e:
                raise bodies.http_error(400, e.error, e.rejected, e.kinds) from None
            st.session_load_s += load_s
        return {
            "ok": True,
            "chunk_index": info.chunk_index,
            "received_bytes": received,
            "load_s": load_s,
            "loaded": len(info.names),
        }

    def _drain(update_info: dict[str, Any]) -> None:
        """Under gloo, inside a session, receive and drop the chunk whose update_info is refused (call under
        the lock): the sender broadcasts while its call is in flight, and as vLLM's gloo plugin receives
        before it parses, the sender never hangs on a refused body. From `src` when it names another rank
        of the group, else from the sender's rank. Nothing when a handle is given (no broadcast then)."""
        if st.backend not in GROUP_BACKENDS or st.group is None or not st.session_open:
            return
        if update_info.get("handle") is not None:
            return
        src = update_info.get("src", SENDER_RANK)
        usable = isinstance(src, int) and not isinstance(src, bool) and 0 <= src < st.group.world_size
        st.group.receive_chunk(src if usable and src not in _own_ranks() else SENDER_RANK)

    def _own_ranks() -> set[int]:
        """This engine's ranks in the transfer group (one, or one per TP rank)."""
        assert st.group is not None
        return st.group.ranks if isinstance(st.group, TpRanks) else {st.group.rank}

    def _require_session(info: UpdateInfo, chunk: str, what: str) -> None:
        if not st.session_open:
            raise receive.ChunkRejected(
                f"{chunk} ({what}): no update session is open; POST /start_weight_update first",
                dict.fromkeys(info.names, "no update session open"),
                dict.fromkeys(info.names, "session"),
            )

    def _apply(info: UpdateInfo, chunk: str, payload: torch.Tensor) -> float:
        t0 = time.perf_counter()
        st.applier.apply(chunk, info.names, info.dtype_names, info.shapes, payload)
        return time.perf_counter() - t0

    def _receive_broadcast(info: UpdateInfo, chunk: str) -> tuple[int, float]:
        if info.handle is not None:
            raise receive.ChunkRejected(
                f"{chunk}: update_info carries a {info.handle.get('kind', '?')!r} handle but the transfer backend "
                f"is {st.backend} (nothing was received); init with the colocate backend or send by broadcast",
                dict.fromkeys(info.names, f"handle under backend {st.backend}"),
                dict.fromkeys(info.names, "bytes"),
            )
        assert st.group is not None
        # As vLLM's worker: no session, no receive (the sender must not broadcast then; see client.py).
        _require_session(info, chunk, "nothing received")
        if info.src in _own_ranks() or info.src >= st.group.world_size:
            why = f"src {info.src} is not a sender in the transfer group (this engine is rank {st.group.rank} of "
            why += f"{st.group.world_size}); the chunk was received from rank {SENDER_RANK} and dropped"
            _drain({"src": SENDER_RANK})
            raise receive.ChunkRejected(
                f"{chunk}: {why}", {"body.update_info.src": why}, {"body.update_info.src": "request"}
            )
        payload = st.group.receive_chunk(info.src)  # with a session: receive first, check after
        return int(payload.numel()), _apply(info, chunk, payload)

    def _receive_handle(info: UpdateInfo, chunk: str) -> tuple[int, float]:
        # Session, metadata, then the handle (the one validation, against the declared size): a handle is
        # mapped only for a chunk the engine would load.
        assert st.backend is not None
        _require_session(info, chunk, "its handle was not opened")
        nbytes = st.applier.check(chunk, info.names, info.dtype_names, info.shapes)
        handle = receive.check_handle(info.handle, st.backend, chunk, info.names, nbytes)
        with contextlib.ExitStack() as stack:
            payload = receive.open_handle(stack, handle, chunk, info.names)
            try:
                return int(payload.numel()), _apply(info, chunk, payload)
            finally:
                del payload  # every view of the shared buffer is gone before the handle closes

    @app.post("/transfer_probe")
    def transfer_probe(req: ProbeRequest) -> dict[str, Any]:
        route = "/transfer_probe"
        with st.lock:
            if st.backend not in GROUP_BACKENDS or st.group is None or st.session_open:
                why = (
                    f"a transfer probe needs a joined transfer group and no open session (backend {st.backend}, "
                    f"session open: {st.session_open}); POST /init_weight_transfer_engine with a group backend first"
                )
                raise bodies.http_error(400, why, {route: why}, {route: "session"})
            groups = st.group.groups if isinstance(st.group, TpRanks) else [st.group]
            size = max(req.sizes, default=0)
            buffers = [torch.empty(size, dtype=torch.uint8, device=g.device) for g in groups]
            for n in req.sizes:  # every TP rank takes every broadcast at once, as for a chunk
                if isinstance(st.group, TpRanks):
                    pool, pairs = st.group.pool, zip(groups, buffers, strict=True)
                    futures = [pool.submit(g.broadcast, b[:n], SENDER_RANK) for g, b in pairs]
                    for f in futures:
                        f.result()
                else:
                    groups[0].broadcast(buffers[0][:n], SENDER_RANK)
        return {"ok": True, "received_bytes": sum(req.sizes)}

    @app.post("/finish_weight_update")
    def finish_weight_update(req: FinishRequest | None = None) -> dict[str, Any]:
        with st.lock:
            if not st.session_open:
                why = "finish_weight_update called without an open session; POST /start_weight_update first"
                raise bodies.http_error(400, why, {"/finish_weight_update": why}, {"/finish_weight_update": "session"})
            st.session_open = False
            if req is not None and req.weight_version is not None:
                st.commit_version(req.weight_version)
            return {
                "weight_version": st.weight_version,
                "update_counts": dict(st.loader.counts),
                "load_s": st.session_load_s,
            }

    @app.post("/v1/completions")
    def completions(req: CompletionRequest) -> dict[str, Any]:
        try:
            inputs = st.completer.prepare(req)  # reads no weights: outside the lock
            with st.lock:
                why = st.serving_refusal()
                if why is not None:
                    fix = "POST /finish_weight_update" if st.session_open else "POST /resume"
                    raise CompletionError(
                        409,
                        f"/v1/completions refused: {why} (weights may be half-updated); {fix} first",
                        {"/v1/completions": why},
                        kind="session",
                    )
                return st.completer.complete(req, inputs, st.weight_version)
        except CompletionError as e:
            raise bodies.http_error(e.status, e.error, e.rejected, e.kinds) from None

    @app.post("/weight_checker")
    def weight_checker(req: CheckerRequest) -> dict[str, Any]:
        with st.lock:
            if req.action == "shards":
                return {"shards": st.loader.shard_ids()}
            if req.action == "reset":
                st.loader.reset_weights()
                return {"status": "reset"}
            sums = st.loader.checksums()
            tp_sums = st.ranks.checksums() if st.ranks is not None else None
        if req.action == "checksum":  # with TP ranks also each rank's shards, in vLLM names
            extra = {"tp_checksums": tp_sums} if tp_sums else {}
            return {"checksums": sums, "weight_version": st.weight_version, **extra}
        if req.baseline is None:
            raise bodies.request_error(
                "/weight_checker", "body.baseline", "action 'compare' requires a 'baseline' object {hf_name: checksum}"
            )
        keys = set(sums) | set(req.baseline)
        mismatches = sorted(k for k in keys if sums.get(k) != req.baseline.get(k))
        return {"match": not mismatches, "mismatches": mismatches, "weight_version": st.weight_version}

    return app


if __name__ == "__main__":
    raise SystemExit(
        "run the engine as `python -m reference_impl.engine.embedded` (this module must be imported under its "
        "own name, so that fault hooks replace what the app calls)"
    )
