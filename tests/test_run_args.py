"""A run's command-line inputs that name places (`harness.run_args`), and what `python -m harness run` says
before anything starts."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness_cli import harness_run

from harness.run_args import ray_address_problem, results_folder

ROOT = Path(__file__).resolve().parents[1]


def test_a_run_id_names_one_new_folder_under_the_results_dir(tmp_path: Path) -> None:
    assert results_folder(tmp_path, "r1") == "r1"
    (tmp_path / "r1").mkdir()
    (tmp_path / "r1" / "console.log").write_text("")  # a folder the caller made for its own files is taken
    assert results_folder(tmp_path, "r1") == "r1"
    (tmp_path / "r1" / "records").mkdir()  # an earlier run's: its summary would be overwritten, its records mixed
    with pytest.raises(ValueError, match=r"r1 holds an earlier run \(records\): pick another --run-id"):
        results_folder(tmp_path, "r1")
    for bad in ("../escape", "a/b", ".."):
        with pytest.raises(ValueError, match="is no folder name"):
            results_folder(tmp_path, bad)
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match="afile is a file: pass a folder"):
        results_folder(tmp_path / "afile", "r2")
    with pytest.raises(ValueError, match="afile is a file: pass a folder"):
        results_folder(tmp_path / "afile" / "sub", "r2")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="dangling links to nothing"):
        results_folder(tmp_path / "dangling", "r2")
    with pytest.raises(ValueError, match="afile is a file: pick another --run-id"):
        results_folder(tmp_path, "afile")
    with pytest.raises(ValueError, match="is 300 bytes long: a folder name holds at most 255"):
        results_folder(tmp_path, "x" * 300)
    assert results_folder(tmp_path, "r3", claim=True) == "r3" and (tmp_path / "r3").is_dir()


def test_a_default_run_id_is_a_timestamp_that_steps_past_an_earlier_run_of_the_same_second(tmp_path: Path) -> None:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    first = results_folder(tmp_path, None)
    if first != stamp:  # the clock turned a second meanwhile
        stamp = first
    (tmp_path / stamp).mkdir()
    (tmp_path / stamp / "env.json").write_text("{}")
    second = results_folder(tmp_path, "")
    assert second in (f"{stamp}-2", time.strftime("%Y%m%d-%H%M%S")) and second != stamp
    # two runs of one second: the first claims its folder as it picks it, so the second steps past it
    claimed = [results_folder(tmp_path / "claims", None, claim=True) for _ in range(3)]
    assert len(set(claimed)) == 3 and all((tmp_path / "claims" / c).is_dir() for c in claimed)


# what a gRPC server sends first (RFC 9113 3.4, 6.5): a SETTINGS frame, here with no settings
SERVER_PREFACE = bytes(3) + b"\x04" + bytes(5)


@contextlib.contextmanager
def serving(reply: bytes | None, family: socket.AddressFamily = socket.AF_INET) -> Iterator[int]:
    """A listener on the loopback's port (yielded) that answers each connection with `reply` once the client has
    spoken, or with nothing (None) until the test ends."""
    with socket.socket(family) as listening:
        listening.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", 0))
        listening.listen()

        def serve() -> None:
            while True:
                try:
                    conn, _ = listening.accept()
                except OSError:  # closed: the test ended
                    return
                with conn:
                    conn.recv(64)
                    if reply is None:
                        conn.recv(64)  # until the client goes
                    else:
                        conn.sendall(reply)

        threading.Thread(target=serve, daemon=True).start()
        yield listening.getsockname()[1]
        listening.shutdown(socket.SHUT_RDWR)


def test_a_ray_address_where_no_grpc_server_listens_is_refused() -> None:
    with serving(SERVER_PREFACE) as port:
        assert ray_address_problem(f"127.0.0.1:{port}") is None
    problem = ray_address_problem(f"127.0.0.1:{port}")  # closed now: Ray retried it every 30 s without end
    assert problem is not None and problem.startswith(f"nothing answers at --ray-address 127.0.0.1:{port}")
    # an HTTP/1 server (e.g. the dashboard's port), and one that says nothing: Ray retried both without end too
    for reply in (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", b"", None):
        with serving(reply) as port:
            problem = ray_address_problem(f"127.0.0.1:{port}", timeout_s=0.5) or ""
        assert problem.startswith(f"what answers at --ray-address 127.0.0.1:{port} is no Ray head"), (reply, problem)
    for bad in ("nonsense", "localhost:99999", "http://127.0.0.1:6379", ":6379", "127.0.0.1:²", "127.0.0.1:٦٣٩٩"):
        assert "no host:port of a Ray head" in (ray_address_problem(bad) or ""), bad
    with serving(SERVER_PREFACE, socket.AF_INET6) as port:
        assert ray_address_problem(f"[::1]:{port}") is None
    assert ray_address_problem("auto") is None
    long_label = "a" * 70  # IDNA refuses a label over 63 characters: a UnicodeError, not an OSError
    problem = ray_address_problem(f"{long_label}:6379") or ""
    assert problem.startswith(f"--ray-address '{long_label}:6379': '{long_label}' is no host name"), problem


def test_a_ray_client_address_needs_rays_client_and_a_grpc_server(monkeypatch: pytest.MonkeyPatch) -> None:
    # without ray[client], Ray refused ray:// only after the run had made its folder
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # no grpc: ray[client] not installed
    no_client = ray_address_problem("ray://127.0.0.1:10001") or ""
    assert no_client.startswith("--ray-address ray://127.0.0.1:10001 needs Ray's client"), no_client
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    with serving(SERVER_PREFACE) as port:
        assert ray_address_problem(f"ray://127.0.0.1:{port}") is None
    assert (ray_address_problem(f"ray://127.0.0.1:{port}") or "").startswith("nothing answers at --ray-address ray://")
    assert "no host:port of a Ray head" in (ray_address_problem("ray://nonsense") or "")


def test_a_cluster_that_asks_for_rays_token_says_how_to_send_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from harness import driver_ray

    def refused(**kwargs: object) -> None:  # as Ray 2.60 ends a ray.init whose cluster wants a token
        try:
            raise RuntimeError("Failed to connect to GCS. ... AuthenticationError: RPC error: InvalidAuthToken")
        except RuntimeError as e:
            raise ConnectionError("Failed to connect to Ray cluster at 192.0.2.2:46400") from e

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refused)
    with pytest.raises(ValueError, match="asks for Ray's token and this driver sends none: export RAY_AUTH_MODE=token"):
        driver_ray.ensure_ray("127.0.0.1:46400")
    monkeypatch.setattr(ray, "init", lambda **kwargs: (_ for _ in ()).throw(ConnectionError("no GCS")))
    with pytest.raises(ConnectionError, match="no GCS"):  # any other failure to connect stays Ray's
        driver_ray.ensure_ray("127.0.0.1:46400")


def test_bad_places_are_refused_before_anything_starts_and_a_config_error_says_why(tmp_path: Path) -> None:
    matrix = tmp_path / "m.yaml"
    matrix.write_text("- {model: qwen3, syncs: 1, tp: 3}\n")
    baseline = tmp_path / "baseline"
    baseline.mkdir()
    (baseline / "summary.csv").write_text("a,b\n")
    refused = subprocess.run(
        harness_run(matrix, tmp_path / "out", "--baseline", str(baseline)), capture_output=True, text=True, cwd=ROOT
    )
    assert refused.returncode == 2 and "is no run's summary table" in refused.stderr, refused.stderr[-2000:]
    assert not (tmp_path / "out").exists()  # checked before the run: it used to run every scenario, then fail
    argv = harness_run(matrix, tmp_path / "out", "--run-id", "r")
    run = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 1
    # the terminal says what to change, not only the verdict (also in summary.md and the record)
    assert "TP 3 divides neither qwen3's 4 attention heads nor its 2 KV heads" in run.stderr, run.stderr[-2000:]
    again = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 2 and "holds an earlier run" in again.stderr, again.stderr[-2000:]


@pytest.mark.parametrize("command", ["run", "list", "faults", "soak", "report"])
def test_every_command_answers_help_with_its_own_options(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    from harness.cli import _parser

    with pytest.raises(SystemExit) as done:  # `faults` has no --matrix: its help once raised "empty group"
        _parser().parse_args([command, "--help"])
    assert done.value.code == 0
    usage = capsys.readouterr().out
    assert usage.startswith(f"usage: python -m harness {command}")
    own = {"run": "--matrix", "list": "--faults", "faults": "--filter", "soak": "--syncs", "report": "--baseline"}
    assert own[command] in usage and ("--matrix" in usage) == (command in ("run", "list", "soak"))
