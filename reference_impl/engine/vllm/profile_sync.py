"""Where a sync into real vLLM spends its time: the sender's side, the HTTP calls, and vLLM's engine core.

Run from the repository root with the TRAINER environment (it imports the harness's transport):

    python -m reference_impl.engine.vllm.profile_sync [--model qwen3-0.6b] [--syncs 3] [--py-spy]

It makes the model entry's seeded checkpoint (Qwen3-0.6B at its real size, bf16, by default), starts
vLLM on it through the harness's launcher (`--load-format dummy`, this checkout's plugin), connects the
transfer channel the vLLM engine kind uses on this host, and sends the checkpoint through the harness's
own `run_sync` (one rank, no Megatron export: only the transfer and vLLM's load are timed): one warm-up
sync, then `--syncs` steady ones. Per steady sync it reports the wall time, the time of each route's
calls, and the sender's packing and wire time (the channel's `timing`); the engine's own steps from the
backend's timing lines in vLLM's log; and the fixed cost of one /update_weights round trip (an update
that carries no tensor). With `--py-spy`, `py-spy record`
samples every process of the server during the steady syncs (`--subprocesses --nonblocking`, 100 Hz) and
the samples are split into the categories of `CATEGORIES` (the first whose frame appears in a stack),
in seconds of CPU time summed over the steady syncs. Prints one JSON report (and writes it to `--json`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# (category, frame substrings): a sample counts for the first category one of whose substrings is in one of
# its frames (py-spy's "function (file:line)"). Ours first, then vLLM's innermost steps, then the outer ones.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ours: receive (broadcast over the transfer group)", ("receive_chunk (", "receive_packed (", "_bcast (")),
    ("ours: unpack and dtype check", ("unpack (", "unpack_tensor (", "_check_dtypes (", "split_packed (")),
    ("ours: CPU embedding (tied lm_head) repack", ("_repack_cpu_embedding_gemms (",)),
    ("ours: abort after a failed chunk", ("_abort_layerwise_reload (",)),
    ("vLLM: repack (process_weights_after_loading)", ("process_weights_after_loading (",)),
    ("vLLM: copy into the kernel tensors", ("_copy_and_restore_kernel_tensors (", "_place_kernel_tensors (")),
    ("vLLM: materialize a layer", ("materialize_layer (",)),
    ("vLLM: weight loaders (qkv/gate-up into params)", ("_layerwise_process (", "_finalize_attention_layer (")),
    ("vLLM: finalize layerwise reload (other)", ("finalize_layerwise_processing (",)),
    ("vLLM: start (initialize_layerwise_reload)", ("initialize_layerwise_reload (",)),
    ("vLLM: load_weights (name mapping, buffering)", ("load_weights (",)),
    (
        "vLLM: worker RPC (update/start/finish, other)",
        ("update_weights (", "start_weight_update (", "finish_weight_update (", "collective_rpc ("),
    ),
)
OTHER = "other (API server, engine-core loop, ...)"
PY_SPY_RATE = 100  # samples per second


def split_samples(lines: Iterable[str], rate: int = PY_SPY_RATE) -> dict[str, float]:
    """CPU seconds per category (`CATEGORIES`, else `OTHER`) of py-spy's raw (collapsed) output.

    Each line is `frame;frame;...;frame COUNT` (py-spy `--format raw`); a line's samples go to the first
    category one of whose substrings occurs in the line. Returns {category: COUNT / rate}, only categories
    with samples, in `CATEGORIES` order then `OTHER`.

    Raises:
        ValueError: a non-empty line that does not end in an integer count.
    """
    counts: dict[str, int] = defaultdict(int)
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            raise ValueError(f"not a py-spy raw line (no trailing count): {line[:200]!r}")
        label = next((c for c, subs in CATEGORIES if any(s in stack for s in subs)), OTHER)
        counts[label] += int(count)
    order = [c for c, _ in CATEGORIES] + [OTHER]
    return {c: counts[c] / rate for c in order if counts.get(c)}


_LOGGED = re.compile(r"gloo weight transfer: (?P<what>update|start|finish)(?P<rest>.*)")
_SECONDS = re.compile(r"(?P<name>[a-z][a-z ]*?) (?P<s>\d+\.\d+)s")


def engine_log_seconds(lines: Iterable[str]) -> dict[str, float]:
    """Seconds per step from the `gloo` backend's timing lines in vLLM's log (`wsh_vllm_plugin/engine.py`):
    "update: ...; receive 0.101s, unpack 0.000s, load 0.423s", "start 0.051s", "finish: finalize 1.2s,
    embedding repack 0.3s". Returns {"<route> <step>": summed seconds}, e.g. "update receive"."""
    out: dict[str, float] = defaultdict(float)
    for line in lines:
        m = _LOGGED.search(line)
        if not m:
            continue
        what, rest = m.group("what"), m.group("rest")
        if what == "start":
            s = re.search(r"(\d+\.\d+)s", rest)
            if s:
                out["start"] += float(s.group(1))
            continue
        for part in rest.split(";")[-1].split(",") if what == "update" else rest.split(":", 1)[-1].split(","):
            p = _SECONDS.search(part.strip())
            if p:
                out[f"{what} {p.group('name').strip()}"] += float(p.group("s"))
    return dict(out)


def _route_ms(calls: Sequence[Any], sync: int) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for c in calls:
        if c.sync == sync:
            out[c.route] += c.ms
    return {k: round(v, 1) for k, v in out.items()}


def _empty_update_ms(client: Any, channel: Any, sync: int, calls: int = 9) -> float:
    """The fixed cost of one /update_weights round trip (HTTP, vLLM's API server, its engine core, the
    worker's RPC): the median ms of `calls` updates that carry no tensor, in one session of their own."""
    from wsh_vllm_plugin.protocol import UpdateInfo

    client.start(sync, sync)
    ms = []
    for i in range(calls):
        channel.send(client, [], UpdateInfo(names=[], dtype_names=[], shapes=[], chunk_index=i), sync)
        ms.append(client.calls[-1].ms)
    client.finish(sync, sync)
    return round(sorted(ms)[len(ms) // 2], 1)


def _start_py_spy(pid: int, out: Path) -> subprocess.Popen[bytes] | None:
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        return None
    cmd = [
        exe,
        "record",
        "--pid",
        str(pid),
        "--subprocesses",
        "--nonblocking",
        "--rate",
        str(PY_SPY_RATE),
        "--format",
        "raw",
        "--output",
        str(out),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(2.0)  # py-spy attaches to every process of the tree before the syncs begin
    return proc


def _stop_py_spy(proc: subprocess.Popen[bytes]) -> str:
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err.decode(errors="replace")[-500:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--syncs", type=int, default=3, help="steady syncs after the warm-up one")
    ap.add_argument("--chunk-bytes", type=int, default=256 << 20)
    ap.add_argument("--py-spy", action="store_true", help="sample the server's processes during the steady syncs")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "wsh-vllm-profile.log")
    args = ap.parse_args()

    from safetensors.torch import load_file

    from reference_impl.cuda import cuda_available
    from reference_impl.engine import engine_kind
    from reference_impl.engine.vllm.launcher import VllmEngineProcess
    from reference_impl.models.checkpoint import make_checkpoint
    from reference_impl.models.registry import load_model
    from reference_impl.transport.channels import connect_channel
    from reference_impl.transport.client import EngineClient
    from reference_impl.transport.sync import run_sync

    ckpt = make_checkpoint(load_model(args.model), 1234, args.dtype)
    named: list[tuple[str, Any]] = []
    for f in sorted(ckpt.glob("*.safetensors")):
        named.extend(load_file(str(f)).items())
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    kind = engine_kind("vllm")
    proc = VllmEngineProcess(str(ckpt), 4321, str(args.log), dtype=args.dtype)
    report: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "bytes_per_sync": nbytes,
        "chunk_bytes": args.chunk_bytes,
        "log": str(args.log),
    }
    with proc:  # stopped also when the profile raises or is interrupted while the server starts
        t0 = time.perf_counter()
        url = proc.start(kind.start_timeout_s)
        report["start_s"] = round(time.perf_counter() - t0, 1)
        client = EngineClient(
            url,
            timeout_s=900,
            session_ends_on_error=kind.capabilities.session_ends_on_error,
            parse_rejections=kind.parse_rejections,
            pauses_generation=not kind.capabilities.refuses_completions_in_session,  # as the trainer's sender
        )
        spy: subprocess.Popen[bytes] | None = None
        raw = Path(tempfile.gettempdir()) / f"wsh-vllm-profile-{os.getpid()}.raw"
        try:
            transfer = kind.transfer(colocate=False, cuda=cuda_available())
            channel = connect_channel(client, transfer.wire, transfer.backend)
            report["transfer"] = {"wire": transfer.wire, "backend": transfer.backend}
            log_offset = 0
            syncs = []
            for i in range(args.syncs + 1):
                if i == 1:
                    log_offset = args.log.stat().st_size if args.log.exists() else 0
                    if args.py_spy:
                        spy = _start_py_spy(proc.pid() or 0, raw)
                t = time.perf_counter()
                res, plan = run_sync(
                    named=named,
                    rank=0,
                    world_size=1,
                    chunk_bytes=args.chunk_bytes,
                    sync_index=i,
                    weight_version=i,
                    client=client,
                    channel=channel,
                )
                wall = time.perf_counter() - t
                assert res.finished and not res.names_rejected, (res.names_rejected, client.calls[-1])
                timing = dict(getattr(channel, "timing", {}))
                syncs.append(
                    {
                        "sync": i,
                        "wall_s": round(wall, 3),
                        "chunks": len(plan),
                        "routes_ms": _route_ms(client.calls, i),
                        "sender": {k: round(v, 3) for k, v in timing.items()},
                    }
                )
                if hasattr(channel, "timing"):
                    channel.timing.clear()
            if spy is not None:
                report["py_spy_stderr"] = _stop_py_spy(spy)
                spy = None
                per = split_samples(raw.read_text().splitlines()) if raw.exists() else {}
                report["engine_cpu_s_per_steady_sync"] = {k: round(v / args.syncs, 3) for k, v in per.items()}
                report["py_spy_raw"] = str(raw)
            if args.log.exists() and args.syncs:
                with open(args.log, errors="replace") as f:
                    f.seek(log_offset)
                    logged = engine_log_seconds(f.read().splitlines())
                report["engine_logged_s_per_steady_sync"] = {k: round(v / args.syncs, 3) for k, v in logged.items()}
            report["syncs"] = syncs
            steady = [s["wall_s"] for s in syncs[1:]]
            report["steady_wall_s_median"] = sorted(steady)[len(steady) // 2] if steady else None
            report["empty_update_ms_median"] = _empty_update_ms(client, channel, args.syncs + 1)
            channel.close()
        finally:
            if spy is not None:
                _stop_py_spy(spy)
            client.close()
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
