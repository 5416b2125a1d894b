"""The same bad inputs to vLLM and the embedded engine (unknown name, wrong shape, wrong dtype, update
without a session, a refused start, a failed chunk among many), each through the harness's own sender:
`harness.checks.judge` must give both engines' records the same verdict, and each engine's parser must read
its answer as the same rejections. After the bad inputs, a clean sync must leave vLLM's prompt log-probs
equal to a transformers forward over the checkpoint: vLLM still serves, and serves the right weights."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from wsh_vllm_plugin.protocol import UpdateInfo

from reference_impl.transport.client import EngineRejected

from .engines import (
    Connected,
    full,
    measure_logprobs,
    sent_in_order,
    short_tensor_refused,
    unknown_name_refused,
    verdict_of,
)


def test_unknown_name_is_name_error_on_both(engines: dict[str, Connected]) -> None:
    records = unknown_name_refused(engines, "model.layers.0.self_attn.no_such.weight", 1)
    vllm_call = next(c for c in records["vllm"].http if c.status != 200)
    assert vllm_call.status == 500 and "no_such" in (vllm_call.error or "")
    embedded_call = next(c for c in records["embedded"].http if c.status != 200)
    assert embedded_call.status == 400


def test_wrong_shape_is_http_error_on_both(engines: dict[str, Connected]) -> None:
    # vLLM's loader names no tensor ("Attempted to load weight (torch.Size([63])) into parameter ...").
    assert "torch.Size([63])" in short_tensor_refused(engines, "model.layers.1.input_layernorm.weight", 2)


def test_wrong_dtype_is_http_error_on_both(engines: dict[str, Connected]) -> None:
    target = "model.norm.weight"

    def named(ckpt: Path) -> list[tuple[str, torch.Tensor]]:
        return [(n, t.to(torch.bfloat16) if n == target else t) for n, t in full(ckpt)]

    records = sent_in_order(engines, named, 3)
    for kind, rec in records.items():
        verdict, message = verdict_of(rec)
        assert verdict == "HTTP_ERROR", (kind, verdict, message)
        assert "dtype" in message and target in message, (kind, message)
        call = next(c for c in rec.http if c.status != 200)
        assert [(r.name, r.kind) for r in call.rejections] == [(target, "dtype")], (kind, call)
        assert list(rec.syncs[0].names_rejected) == [target], kind


def test_update_without_start_is_http_error_on_both(engines: dict[str, Connected]) -> None:
    """Neither engine takes bytes without a session, so nothing is broadcast (a broadcast would hang)."""
    info = UpdateInfo(names=["model.norm.weight"], dtype_names=["float32"], shapes=[[64]], chunk_index=0)
    for kind, conn in engines.items():
        conn.client.calls = []
        with pytest.raises(EngineRejected) as exc:
            conn.client.update(info, sync=4, chunk=0)
        assert exc.value.status in (400, 409, 500), (kind, exc.value)
        assert "start_weight_update" in exc.value.body, (kind, exc.value.body)
        assert [r.kind for r in exc.value.rejections] == ["session"], (kind, exc.value.rejections)
        verdict, message = verdict_of(conn.record([], 4))
        assert verdict == "HTTP_ERROR", (kind, verdict, message)


def test_refused_start_sends_nothing_on_both(engines: dict[str, Connected]) -> None:
    """A sync whose /start_weight_update is refused (a session is already open): through the harness's
    own sender, no chunk may be broadcast (neither engine would receive it: the trainer would hang), and
    both engines' records get the same verdict."""
    for kind, conn in engines.items():
        conn.client.start(sync=7)  # the session a previous step left open
        rec = conn.sync(full(conn.checkpoint), 8, chunk_bytes=20_000)
        verdict, message = verdict_of(rec)
        assert verdict == "HTTP_ERROR" and "/start_weight_update" in message, (kind, verdict, message)
        chunks = rec.syncs[0].chunks
        assert len(chunks) > 10 and not any(c.sent for c in chunks)
        assert all("start_weight_update was refused" in c.note for c in chunks)
        assert [c.route for c in rec.http] == ["/start_weight_update"]  # no update, no finish
        conn.client.finish(sync=7, weight_version=7)  # close the session left open


def test_failed_chunk_ends_vllm_session_without_hanging(engines: dict[str, Connected]) -> None:
    """Many chunks, the first bad. vLLM ends its session, so the sender must not broadcast any later chunk
    (nobody would receive it); the embedded engine keeps the session and takes them. Same verdict."""
    bad = "model.layers.0.mlp.no_such.weight"

    def named(ckpt: Path) -> list[tuple[str, torch.Tensor]]:
        return [(bad, torch.ones(64)), *full(ckpt)]

    records = {kind: conn.sync(named(conn.checkpoint), 5, chunk_bytes=2048) for kind, conn in engines.items()}
    for kind, rec in records.items():
        verdict, message = verdict_of(rec)
        assert verdict == "NAME_ERROR", (kind, verdict, message)
        assert rec.syncs[0].chunks_planned > 2
    vllm_chunks = records["vllm"].syncs[0].chunks
    assert vllm_chunks[0].sent and not any(c.sent for c in vllm_chunks[1:])
    assert all("the engine ended the session when chunk 0 failed" in c.note for c in vllm_chunks[1:])
    assert all(c.received for c in records["embedded"].syncs[0].chunks[1:])


def test_vllm_serves_the_checkpoint_after_the_bad_inputs(engines: dict[str, Connected]) -> None:
    """After a sync that fails halfway (a bad name in its third chunk), a clean sync in many chunks must
    PASS on both engines, and vLLM's log-probs must then equal a transformers forward over the checkpoint."""
    for kind, conn in engines.items():
        broken = full(conn.checkpoint)
        broken.insert(len(broken) // 2, ("model.layers.1.mlp.no_such.weight", torch.ones(64)))
        assert verdict_of(conn.sync(broken, 9, chunk_bytes=20_000))[0] == "NAME_ERROR", kind
    for kind, conn in engines.items():
        rec = conn.sync(full(conn.checkpoint), 6, chunk_bytes=20_000)
        measure_logprobs(conn, rec)
        verdict, message = verdict_of(rec)
        assert verdict == "PASS", (kind, verdict, message)
        assert rec.syncs[0].chunks_planned > 10
        assert rec.syncs[0].logprobs["max_abs"] < 1e-4 and rec.syncs[0].logprobs["tokens"] > 40
    assert httpx.get(engines["vllm"].client.base_url + "/health", timeout=10).status_code == 200
