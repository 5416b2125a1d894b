"""A run's command-line inputs that name places, checked before anything starts: the results folder and run id
(`python -m harness run|faults|soak --results-dir DIR --run-id ID`), and the Ray cluster to join
(`--ray-address`). Each bad one gets a sentence that says what to change (`harness.cli.main` prints it and
exits 2)."""

from __future__ import annotations

import importlib.util
import os
import socket
import time
from pathlib import Path

EARLIER_RUN = ("summary.csv", "env.json", "records")  # what a run writes into its folder


def results_folder(results_dir: Path, run_id: str | None, claim: bool = False) -> str:
    """The run id a run writes `results_dir/<run id>/` under: `run_id`, or (for none or an empty one) a timestamp
    (`20261206-182348`, then `-2`, `-3`, ... where a run of the same second is there). Nothing recorded is
    overwritten: a folder that holds an earlier run (its summary.csv, env.json or records/) is refused, not
    mixed with the new one. With `claim`, the run's folder is made here (a timestamp's atomically: two runs
    started in the same second took the same folder when the second one looked before the first wrote).

    Raises:
        ValueError: `results_dir` is a file, a link to nowhere or inside a file; `run_id` is no folder name
            (`.`, `..`, with a `/`: the folder would land outside `results_dir`, or longer than a name may be);
            `results_dir/run_id` is a file or holds an earlier run; with `claim`, the folder cannot be made.
    """
    for folder in (results_dir, *results_dir.parents):
        if folder.is_symlink() and not folder.exists():
            raise ValueError(f"--results-dir: {folder} links to nothing: pass a folder (made where missing)")
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"--results-dir: {folder} is a file: pass a folder (made where missing)")
    if not run_id:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        n, run_id = 1, stamp
        while _taken(results_dir / run_id, claim):
            n += 1
            run_id = f"{stamp}-{n}"
        return run_id
    if run_id in (".", "..") or "/" in run_id or os.sep in run_id:
        raise ValueError(f"--run-id {run_id!r} is no folder name: use one without '/' (its folder is in --results-dir)")
    if len(os.fsencode(run_id)) > 255:
        raise ValueError(f"--run-id is {len(os.fsencode(run_id))} bytes long: a folder name holds at most 255")
    folder = results_dir / run_id
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--run-id: {folder} is a file: pick another --run-id")
    earlier = _earlier_run(folder)
    if earlier:
        raise ValueError(
            f"{folder} holds an earlier run ({', '.join(earlier)}): pick another --run-id, or move that folder away"
        )
    if claim:
        _make(folder, exist_ok=True)
    return run_id


def _earlier_run(folder: Path) -> list[str]:
    """What of an earlier run `folder` holds (of `EARLIER_RUN`)."""
    return [name for name in EARLIER_RUN if (folder / name).exists()]


def _taken(folder: Path, claim: bool) -> bool:
    """Whether a timestamp's folder is another run's; with `claim`, make it unless it is."""
    if _earlier_run(folder):
        return True
    if not claim:
        return False
    try:
        _make(folder, exist_ok=False)
    except FileExistsError:
        return True
    return False


def _make(folder: Path, exist_ok: bool) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=exist_ok)
    except FileExistsError:
        raise
    except OSError as e:
        raise ValueError(f"cannot make the run's folder {folder} ({e.strerror}): pass another --results-dir") from None


def ray_address_problem(address: str, timeout_s: float = 5.0) -> str | None:
    """None where `--ray-address` can be a Ray cluster to join: `auto`, `local`, a host:port (a head's GCS server;
    an IPv6 host in brackets) or a `ray://host:port` client address (where Ray's client is installed), at which
    a gRPC server answers within `timeout_s` (an HTTP/2 SETTINGS frame, `_answers_http2`; with `RAY_USE_TLS` set,
    a TCP connection); else a sentence that says what to change. Ray itself retried an address where nothing or
    something else listens every 30 s, without end, and refused `ray://` without its client only once the run
    had made its folder. Which gRPC service answers is Ray's to find out when it connects."""
    if address in ("auto", "local"):
        return None
    target = address.removeprefix("ray://")
    if target != address and importlib.util.find_spec("grpc") is None:  # Ray's client check (ray/_private/utils.py)
        return (
            f"--ray-address {address} needs Ray's client, which is not installed: pip install 'ray[client]', "
            "or give the head's GCS address host:port (6379 by default), which needs no client"
        )
    host, sep, port = target.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # [::1]:6379
    port_ok = port.isascii() and port.isdigit() and 0 < int(port) < 65536  # not `²` or `٦٣٩٩`, which isdigit takes
    if "://" in target or not sep or not host or not port_ok:
        return f"--ray-address {address!r} is no host:port of a Ray head (e.g. 127.0.0.1:6379), auto or ray://host:port"
    try:
        connection = socket.create_connection((host, int(port)), timeout=timeout_s)
    except UnicodeError as e:  # a host name no DNS label can hold (IDNA: over 63 characters)
        return f"--ray-address {address!r}: {host!r} is no host name ({e}): give the Ray head's host:port"
    except OSError as e:
        return (
            f"nothing answers at --ray-address {address} ({e.strerror or e}): start Ray there "
            f"(`ray start --head --port {port}`), or leave --ray-address out to start one"
        )
    with connection:
        if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true") or _answers_http2(connection):
            return None
    return (
        f"what answers at --ray-address {address} is no Ray head: it does not speak gRPC, as a head's GCS server "
        "does (`ray start --head` prints its address; the GCS port is 6379 by default, the dashboard's 8265 is no "
        "GCS)"
    )


# RFC 9113 3.4: a client opens with this preface and a SETTINGS frame; the server's first frame is a SETTINGS frame
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS_FRAME = bytes(3) + b"\x04" + bytes(5)  # length 0, type 0x4 (SETTINGS), no flags, stream 0 (RFC 9113 6.5)


def _answers_http2(connection: socket.socket) -> bool:
    """Whether the server on `connection` answers an HTTP/2 client preface with its SETTINGS frame within the
    connection's timeout, as every gRPC server (Ray's GCS and client servers) does. An HTTP/1 server, one that
    closes or one that says nothing does not."""
    try:
        connection.sendall(HTTP2_PREFACE + SETTINGS_FRAME)
        header = b""
        while len(header) < len(SETTINGS_FRAME):
            part = connection.recv(len(SETTINGS_FRAME) - len(header))
            if not part:
                return False
            header += part
    except OSError:  # a reset, or no answer within the timeout
        return False
    return header[3] == SETTINGS_FRAME[3]
