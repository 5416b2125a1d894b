"""Hostile input never gets into the embedded engine and never kills it (one live server, backend shm).

- Handles: pickled calls (torch.save, builtins.eval, os.system) as cuda_ipc handles, segments another
  program made or named by path, sizes other than the chunk's: each a 400 naming the problem, nothing
  written or run, the weights unchanged, then a valid chunk loads exactly.
- Route fuzzing (hypothesis, derandomized): malformed bodies of every kind (`bodies.malformed`) to every
  route inside an open update session, each answered 4xx in the engine's shape naming the field at fault,
  the engine alive after each, nothing loaded (the finish counts are zero) and the checksums unchanged;
  then the routes called in any order with valid and malformed requests mixed, against a model of the
  session and the pause flag.
- Concurrency: completions racing a real multi-chunk sync (the harness's own sender in a thread): refused
  with 409 while the session is open, and every answered one computed on whole weights (the log-probs
  and version of before or of after the sync, never a mix).

The server is started once for the module through `EngineProcess` and stopped by its pid.
"""

from __future__ import annotations

import base64
import builtins
import json
import os
import pickle
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from torch.multiprocessing.reductions import rebuild_cuda_tensor
from wsh_vllm_plugin import protocol
from wsh_vllm_plugin.protocol import InitInfo

from reference_impl.checksum import tensor_checksum
from reference_impl.engine.embedded.answers import parse_rejections
from reference_impl.engine.embedded.launcher import EngineProcess
from reference_impl.engine.process import free_port
from reference_impl.fork_client import ForkServerAddress
from reference_impl.models.checkpoint import make_checkpoint, read_checkpoint
from reference_impl.models.registry import load_model
from reference_impl.transport.client import EngineClient
from reference_impl.transport.colocate import SharedMemoryChannel
from reference_impl.transport.handles import SharedMemoryBuffer
from reference_impl.transport.observed import REJECTION_KINDS
from reference_impl.transport.sync import run_sync

from .bodies import NORM, NORM_BYTES, Bad, PickledCall, Segments, malformed, valid_update

CKPT_SEED, ENGINE_SEED = 1234, 4321
KNOWN = torch.linspace(0.5, 1.5, 64)  # what model.norm.weight holds while the fuzzing runs
SETTINGS = settings(
    deadline=None, derandomize=True, database=None, print_blob=False, suppress_health_check=list(HealthCheck)
)


@dataclass
class Live:
    """The running engine, its checkpoint, and the producer-side segments the bodies point at."""

    proc: EngineProcess
    checkpoint: Path
    good: SharedMemoryBuffer  # >= 512 bytes: KNOWN twice
    small: SharedMemoryBuffer  # 100 bytes: less than one chunk
    vocab: int

    @property
    def url(self) -> str:
        return self.proc.url

    def post(self, route: str, body: Any = None) -> httpx.Response:
        return httpx.post(self.url + route, json=body if body is not None else {}, timeout=60)

    def checksums(self) -> dict[str, str]:
        r = self.post("/weight_checker", {"action": "checksum"})
        assert r.status_code == 200, r.text
        return r.json()["checksums"]

    def segments(self) -> Segments:
        return Segments(self.good.name, self.small.name, protocol.SHM_NAME_PREFIX + "f" * 16)

    def alive(self) -> None:
        assert self.proc.proc is not None and self.proc.proc.poll() is None, self.proc.log_tail()
        assert httpx.get(self.url + "/health", timeout=10).status_code == 200

    def load_known(self) -> None:
        """One valid session loading KNOWN into model.norm.weight (and leaving KNOWN in the segment)."""
        protocol.pack([KNOWN, KNOWN], out=self.good.tensor(2 * NORM_BYTES))
        assert self.post("/start_weight_update").status_code == 200
        r = self.post("/update_weights", {"update_info": valid_update(self.good.name)})
        assert r.status_code == 200, r.text
        assert self.post("/finish_weight_update").status_code == 200


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, fork_server: ForkServerAddress) -> Iterator[Live]:
    ckpt = make_checkpoint(load_model("qwen3"), seed=CKPT_SEED)
    log = tmp_path_factory.mktemp("hostile") / "engine.log"
    proc = EngineProcess(str(ckpt), ENGINE_SEED, log_path=str(log), fork_server=fork_server)
    with SharedMemoryBuffer(4 * NORM_BYTES) as good, SharedMemoryBuffer(100) as small:
        try:
            proc.start(timeout_s=120)
            eng = Live(proc, ckpt, good, small, json.loads((ckpt / "config.json").read_text())["vocab_size"])
            assert eng.post("/init_weight_transfer_engine", {"init_info": {"backend": "shm"}}).status_code == 200
            yield eng
        finally:
            proc.stop()


def refusal(r: httpx.Response, bad: Bad | None = None) -> dict[str, Any]:
    """The answer's detail after checking it is a 4xx in the engine's shape that the harness can read;
    with `bad`, that it names one of its clues."""
    shown = f"{bad.route} {bad.label}: {bad.shown()}" if bad else ""
    assert 400 <= r.status_code < 500, f"{shown} -> {r.status_code}: {r.text[:3000]}"
    detail = r.json()["detail"]
    assert isinstance(detail, dict) and isinstance(detail["error"], str) and detail["error"], (shown, detail)
    assert isinstance(detail["rejected"], dict) and isinstance(detail["kinds"], dict), (shown, detail)
    assert set(detail["kinds"]) == set(detail["rejected"]) and detail["kinds"], (shown, detail)
    assert set(detail["kinds"].values()) <= set(REJECTION_KINDS), (shown, detail)
    assert parse_rejections(bad.route if bad else "", r.status_code, r.text, []), (shown, r.text)
    if bad is not None:
        said = detail["error"] + " " + " ".join(f"{k} {v}" for k, v in detail["rejected"].items())
        assert any(clue in said for clue in bad.clues), (shown, bad.clues, said)
    return detail


# ---------------------------------------------------------------- handles


def _ipc_handle(obj: object) -> dict[str, Any]:
    ipc = base64.b64encode(pickle.dumps(obj)).decode("ascii")
    return {"kind": "cuda_ipc", "ipc": ipc, "nbytes": NORM_BYTES, "device_uuid": ""}


def test_hostile_handles_are_refused_and_the_engine_still_loads(live: Live, tmp_path: Path) -> None:
    live.load_known()
    before = live.checksums()
    written, ran = tmp_path / "written.pt", tmp_path / "ran"
    save = "torch.serialization.save"  # torch.save, as pickle names it
    foreign = SharedMemory(create=True, size=NORM_BYTES)  # another program's segment, holding valid bytes
    try:
        protocol.pack([KNOWN * 3], out=torch.frombuffer(foreign.buf, dtype=torch.uint8, count=NORM_BYTES))
        good = {"kind": "shm", "name": live.good.name, "nbytes": NORM_BYTES}
        real_args = (torch.Tensor, torch.Size([NORM_BYTES]), (1,), 0, torch.storage.TypedStorage, torch.uint8, 0)
        real_args += (b"h" * 64, NORM_BYTES, 0, False, b"r", 0, b"e" * 64, True)
        cases = {
            "torch.save call": (_ipc_handle(PickledCall(torch.save, {"x": 1}, str(written))), [save]),
            "torch.save rebuild": (_ipc_handle((torch.save, ({"x": 1}, str(written)))), [save]),
            "eval call": (_ipc_handle(PickledCall(builtins.eval, f"open({str(ran)!r}, 'w')")), ["builtins.eval"]),
            "os.system call": (_ipc_handle(PickledCall(os.system, f"touch {ran}")), [f"{os.system.__module__}.system"]),
            "reduce_tensor tuple": (_ipc_handle((rebuild_cuda_tensor, real_args)), ["'cuda_ipc'", "backend shm"]),
            "foreign segment": ({**good, "name": foreign.name}, ["not an engine chunk segment", foreign.name]),
            "path as name": ({**good, "name": "../x"}, ["not an engine chunk segment", "'../x'"]),
            "nbytes too large": (
                {**good, "nbytes": NORM_BYTES + 1},
                [f"nbytes {NORM_BYTES + 1}", f"{NORM_BYTES} bytes"],
            ),
            "nbytes too small": (
                {**good, "nbytes": NORM_BYTES - 1},
                [f"nbytes {NORM_BYTES - 1}", f"{NORM_BYTES} bytes"],
            ),
        }
        assert live.post("/start_weight_update").status_code == 200
        for label, (handle, words) in cases.items():
            r = live.post("/update_weights", {"update_info": {**valid_update(live.good.name), "handle": handle}})
            detail = refusal(r)
            assert r.status_code == 400 and detail["kinds"] == {NORM: "bytes"}, (label, detail)
            assert all(w in detail["error"] for w in words), (label, words, detail["error"])
            live.alive()
        assert not written.exists() and not ran.exists()
        assert live.checksums() == before
        # The engine still serves: a valid chunk through the producer's segment loads exactly.
        changed = KNOWN * -2.0
        protocol.pack([changed], out=live.good.tensor(NORM_BYTES))
        r = live.post("/update_weights", {"update_info": valid_update(live.good.name)})
        assert r.status_code == 200, r.text
        counts = live.post("/finish_weight_update").json()["update_counts"]
        assert counts[NORM] == 1 and sum(counts.values()) == 1  # nothing of the refused chunks was loaded
        after = live.checksums()
        assert after[NORM] == tensor_checksum(changed)
        assert {k: v for k, v in after.items() if k != NORM} == {k: v for k, v in before.items() if k != NORM}
    finally:
        foreign.close()
        foreign.unlink()


# ---------------------------------------------------------------- route fuzzing

GROUPS = (
    "update: body",
    "update: chunk",
    "update: handle",
    "init",
    "start",
    "finish",
    "weight_checker",
    "completions",
    "not JSON",
    "wrong route or method",
)


@pytest.mark.parametrize("group", GROUPS)
def test_malformed_bodies_are_refused_by_name(live: Live, group: str) -> None:
    """Inside an open session (so every check is reachable), each malformed request of the group: a 4xx
    naming the problem, the engine alive; at the end nothing was loaded and the checksums are unchanged."""
    live.load_known()
    before = live.checksums()
    strategy = malformed(live.segments(), free_port(), live.vocab)[group]
    assert live.post("/start_weight_update").status_code == 200

    @given(bad=strategy)
    @settings(SETTINGS, max_examples=20)
    def each(bad: Bad) -> None:
        refusal(bad.send(live.url), bad)
        live.alive()

    each()
    r = live.post("/finish_weight_update")
    assert r.status_code == 200, r.text
    assert not any(r.json()["update_counts"].values()), "a malformed request loaded something"
    assert live.checksums() == before


def _machine(live: Live) -> type[RuleBasedStateMachine]:
    """Routes in any order: valid calls against a model of the session and pause flag, and malformed ones
    mixed in. Valid chunks re-send KNOWN, so the weights never change."""
    bads = st.one_of(*malformed(live.segments(), free_port(), live.vocab).values())
    # As the harness's client asks: vLLM's two id fields are taken, any other unknown field is refused.
    prompt = {"prompt": [1, 2, 3, 4], "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    prompt |= {"return_token_ids": True, "return_tokens_as_token_ids": True}
    baseline = live.checksums()

    class RoutesInAnyOrder(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.open = False
            self.paused = False
            self.loads = 0  # valid chunks loaded in the open session

        @rule()
        def start(self) -> None:
            r = live.post("/start_weight_update", {"weight_version": "3"})
            if self.open:
                assert refusal(r)["kinds"] == {"/start_weight_update": "session"}
            else:
                assert r.status_code == 200, r.text
            if not self.open:
                self.open, self.loads = True, 0

        @rule()
        def finish(self) -> None:
            r = live.post("/finish_weight_update", {"weight_version": 3})
            if not self.open:
                assert refusal(r)["kinds"] == {"/finish_weight_update": "session"}
                return
            assert r.status_code == 200, r.text
            counts = r.json()["update_counts"]
            assert counts[NORM] == self.loads and sum(counts.values()) == self.loads
            self.open = False

        @rule()
        def resend(self) -> None:
            r = live.post("/update_weights", {"update_info": valid_update(live.good.name)})
            if not self.open:
                assert refusal(r)["kinds"] == {NORM: "session"}
                return
            assert r.status_code == 200, r.text
            self.loads += 1

        @rule()
        def complete(self) -> None:
            r = live.post("/v1/completions", prompt)
            if self.open or self.paused:
                assert r.status_code == 409 and refusal(r)["kinds"] == {"/v1/completions": "session"}
            else:
                assert r.status_code == 200 and r.json()["choices"][0]["prompt_logprobs"][0] is None, r.text

        @rule(pause=st.booleans())
        def pause_or_resume(self, pause: bool) -> None:
            r = live.post("/pause" if pause else "/resume")
            assert r.status_code == 200, r.text
            self.paused = pause
            assert httpx.get(live.url + "/is_paused", timeout=10).json() == {"is_paused": pause}

        @rule()
        def init_again(self) -> None:
            assert live.post("/init_weight_transfer_engine", {"init_info": {"backend": "shm"}}).status_code == 200

        @rule(bad=bads)
        def malformed(self, bad: Bad) -> None:
            r = bad.send(live.url)
            if bad.stage == "chunk" and not self.open:
                assert refusal(r)["kinds"] == {NORM: "session"}, r.text  # judged only inside a session
            else:
                refusal(r, bad)

        @invariant()
        def alive(self) -> None:
            live.alive()

        def teardown(self) -> None:
            if self.open:
                assert live.post("/finish_weight_update").status_code == 200
            assert live.post("/resume").status_code == 200
            assert live.checksums() == baseline

    return RoutesInAnyOrder


@pytest.mark.filterwarnings("ignore:Generating overly large repr")  # the strategy's own repr, never shown
def test_routes_in_any_order(live: Live) -> None:
    live.load_known()
    machine = _machine(live)
    run_state_machine_as_test(machine, settings=settings(SETTINGS, max_examples=10, stateful_step_count=12))


# ---------------------------------------------------------------- concurrency


def test_completions_racing_a_sync_are_refused_and_never_see_half_the_weights(live: Live) -> None:
    """The harness's sender runs a full sync in many chunks from a thread while this thread keeps
    asking for completions: 409 (kind session) while the session is open, and every 200 carries exactly
    the log-probs and version of the weights before the sync or after it."""
    live.load_known()
    prompt = {"prompt": list(range(1, 17)), "max_tokens": 0, "temperature": 1.0, "prompt_logprobs": 0}

    def complete() -> httpx.Response:
        return live.post("/v1/completions", prompt)

    def answer(r: httpx.Response) -> tuple[int, list[Any]]:
        body = r.json()
        return body["weight_version"], body["choices"][0]["prompt_logprobs"]

    old = answer(complete())
    tensors = read_checkpoint(live.checkpoint)
    client = EngineClient(live.url, timeout_s=60, parse_rejections=parse_rejections)
    client.init_transfer(InitInfo(backend=protocol.SHM))
    channel = SharedMemoryChannel(capacity=1 << 14)
    result: dict[str, Any] = {}

    def sync() -> None:
        try:
            result["report"], result["plan"] = run_sync(
                named=list(tensors.items()),
                rank=0,
                world_size=1,
                chunk_bytes=8 << 10,
                sync_index=1,
                weight_version=old[0] + 1,
                client=client,
                channel=channel,
            )
        except BaseException as e:  # re-raised below, in the test's thread
            result["error"] = e

    thread = threading.Thread(target=sync, name="sync")
    answers: list[httpx.Response] = []
    try:
        thread.start()
        while thread.is_alive():
            answers.append(complete())
        thread.join()
    finally:
        channel.close()
        client.close()
    if "error" in result:
        raise result["error"]
    report = result["report"]
    assert report.finished and report.chunks_planned == len(result["plan"]) > 20
    assert all(c.sent and c.received for c in report.chunks)
    new = answer(complete())
    assert new[0] == old[0] + 1 and new[1] != old[1]  # the sync moved the weights
    assert live.checksums() == {n: tensor_checksum(t) for n, t in tensors.items()}

    refused = [r for r in answers if r.status_code == 409]
    assert refused, f"no completion arrived while the session was open ({len(answers)} sent)"
    for r in refused:
        assert refusal(r)["kinds"] == {"/v1/completions": "session"}
    served = [answer(r) for r in answers if r.status_code == 200]
    assert len(refused) + len(served) == len(answers), [r.status_code for r in answers]
    assert all(a in (old, new) for a in served), "a completion saw weights neither before nor after the sync"
