"""vLLM's packed weight-transfer format as the trainer speaks it (`wsh_vllm_plugin/packed.py`, torch only).

The rules are checked twice: here against values written out by hand (buffer cuts, slot contents,
bodies), and byte for byte against vLLM's own code in vLLM's environment (`vllm_env_packed_oracle.py`
run by vLLM's python: `pack_tensors`, `unpack_tensor` and the typed init/update infos of its `nccl` and
`ipc` backends judge what this module's sender produced). Also: the sender over a real gloo group.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from wsh_vllm_plugin import packed, protocol
from wsh_vllm_plugin.group import host_store, join_transfer_group
from wsh_vllm_plugin.protocol import ProtocolError

from reference_impl.engine.vllm.env import EngineEnvMissing, plugin_import_dir, vllm_python

ORACLE = Path(__file__).with_name("vllm_env_packed_oracle.py")


def test_a_buffer_takes_tensors_until_it_exceeds_the_bound() -> None:
    # bound 10: 4+4 = 8 (not over), +4 = 12 > 10 closes [0, 3); then 4+4+4 = 12 closes [3, 6); 4 is the rest
    assert packed.buffer_spans([4] * 7, 10) == [range(0, 3), range(3, 6), range(6, 7)]
    assert packed.buffer_spans([10, 1], 10) == [range(0, 2)]  # exactly at the bound is not over it
    assert packed.buffer_spans([11, 1], 10) == [range(0, 1), range(1, 2)]  # a big tensor closes its buffer
    assert packed.buffer_spans([3, 3], 1 << 30) == [range(0, 2)]
    assert packed.buffer_spans([], 10) == []
    assert packed.buffer_spans([0, 0, 5], 1) == [range(0, 3)]
    with pytest.raises(ValueError, match=">= 1"):
        packed.buffer_spans([1], 0)


def test_declared_sizes_follow_the_declaration() -> None:
    assert packed.declared_nbytes(["a", "b", "c"], ["bfloat16", "float32", "int64"], [[3, 5], [2], []]) == [30, 8, 8]
    with pytest.raises(ProtocolError, match="2 names, 1 dtype_names, 2 shapes") as e:
        packed.declared_nbytes(["a", "b"], ["float32"], [[1], [1]])
    assert e.value.field == "names"
    with pytest.raises(ProtocolError, match="'float33' is not a torch dtype name") as e:
        packed.declared_nbytes(["a"], ["float33"], [[1]])
    assert e.value.field == "dtype_names"
    with pytest.raises(ProtocolError, match="not a torch dtype name"):
        packed.declared_nbytes(["a"], ["Tensor"], [[1]])  # an attribute of torch, but not a dtype


def test_pack_declared_puts_each_tensor_in_its_declared_slot() -> None:
    a = torch.tensor([1.0, -2.0], dtype=torch.float32)
    b = torch.tensor([[7, 8, 9]], dtype=torch.uint8)
    out = torch.full((16,), 0xAA, dtype=torch.uint8)
    buf = packed.pack_declared([a, b], [8, 3], out)
    expected = bytes(a.numpy().tobytes()) + bytes([7, 8, 9])
    assert buf.numel() == 11 and bytes(buf.tolist()) == expected
    assert out[11:].eq(0xAA).all()  # nothing past the packed buffer is touched


def test_a_tensor_that_differs_from_its_declaration_fills_its_slot_and_no_more() -> None:
    """Declared bfloat16 (2 bytes each) but float32 bytes: the first declared bytes go; a shorter tensor is
    zero-padded. The next tensor's slot starts where the declaration says."""
    f32 = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float32)  # 12 bytes, declared 6
    short = torch.tensor([5], dtype=torch.uint8)  # 1 byte, declared 4
    tail = torch.tensor([9], dtype=torch.uint8)
    buf = packed.pack_declared([f32, short, tail], [6, 4, 1], torch.empty(11, dtype=torch.uint8))
    assert bytes(buf.tolist()) == f32.numpy().tobytes()[:6] + bytes([5, 0, 0, 0, 9])
    with pytest.raises(ValueError, match="holds 3 bytes"):
        packed.pack_declared([f32], [12], torch.empty(3, dtype=torch.uint8))


def test_bodies_are_vllms_fields() -> None:
    body = packed.nccl_init_info(world_size=2, master_address="127.0.0.1", master_port=29555, buffer_size_bytes=64)
    assert body == {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 2,
                    "packed": True, "packed_buffer_size_bytes": 64, "packed_num_buffers": 2}  # fmt: skip
    uid = bytes(range(128))
    by_uid = packed.nccl_init_info(world_size=3, nccl_unique_id=uid)
    assert "master_address" not in by_uid and by_uid["world_size"] == 3
    import base64

    assert base64.b64decode(by_uid["nccl_unique_id_b64"], validate=True) == uid
    for bad in ({"master_address": "h", "master_port": 1, "nccl_unique_id": uid}, {}, {"master_address": "h"}):
        with pytest.raises(ProtocolError):
            packed.nccl_init_info(world_size=2, **bad)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="128 bytes"):
        packed.nccl_init_info(world_size=2, nccl_unique_id=b"x")
    with pytest.raises(ProtocolError, match="rank_offset 2"):
        packed.nccl_init_info(world_size=2, master_address="h", master_port=1, rank_offset=2)
    upd = packed.nccl_update_info(("a",), ("float32",), [(2, 3)])
    assert upd == {"names": ["a"], "dtype_names": ["float32"], "shapes": [[2, 3]]}
    assert tuple(upd) == packed.UPDATE_INFO_KEYS
    assert packed.ipc_init_info() == {"packed": True}


def test_packed_sender_over_a_gloo_group() -> None:
    """The sender's buffers, received on an engine rank in another thread, are the chunk's bytes cut where
    the rule says (bound 20 over 12 + 12 + 4 + 8 bytes: [12, 12] then [4, 8])."""
    store = host_store(timeout_s=30)
    tensors = [torch.arange(3, dtype=torch.float32), torch.arange(3, 6, dtype=torch.float32),
               torch.tensor([1, 2], dtype=torch.int16), torch.tensor([-1], dtype=torch.int64)]  # fmt: skip
    whole = b"".join(t.numpy().tobytes() for t in tensors)

    def engine() -> list[bytes]:
        group = join_transfer_group("127.0.0.1", store.port, rank=1, world_size=2, timeout_s=30)
        out = []
        for n in (24, 12):
            buf = torch.empty(n, dtype=torch.uint8)
            group.broadcast(buf, protocol.SENDER_RANK)
            out.append(bytes(buf.tolist()))
        return out

    with ThreadPoolExecutor(1) as ex:
        got = ex.submit(engine)
        group = join_transfer_group("127.0.0.1", store.port, 0, 2, timeout_s=30, store=store)
        sender = packed.PackedSender(lambda b: group.broadcast(b, protocol.SENDER_RANK), buffer_size_bytes=20)
        sent = sender.send(tensors, [12, 12, 4, 8])
        received = got.result(timeout=60)
    assert sent == [24, 12]
    assert received == [whole[:24], whole[24:]]
    assert sender.send(tensors, [12, 12, 4, 8], keep_going=lambda: False) == []  # stops before any buffer


def _vllm_python_or_skip() -> Path:
    try:
        return vllm_python()
    except EngineEnvMissing as e:
        if os.environ.get("WSH_REQUIRE_VLLM") == "1":
            pytest.fail(f"WSH_REQUIRE_VLLM=1 but {e}")
        pytest.skip(f"no vLLM environment ({e})")


def _cases() -> list[dict[str, object]]:
    """Seeded tensors of mixed dtypes and odd sizes, packed by this module's sender at several bounds."""
    gen = torch.Generator().manual_seed(11)
    spec = [("w.0", (3, 5), torch.bfloat16), ("w.1", (7,), torch.float32), ("ids", (2, 3), torch.int64),
            ("w.2", (1,), torch.float16), ("mask", (5,), torch.uint8), ("w.3", (4, 4), torch.float32),
            ("scalar", (), torch.float32), ("w.4", (9, 2), torch.bfloat16)]  # fmt: skip
    named = []
    for name, shape, dtype in spec:
        t = (
            torch.randint(-1000, 1000, shape, generator=gen)
            if not dtype.is_floating_point
            else torch.randn(shape, generator=gen)
        )
        named.append((name, t.to(dtype) if dtype != torch.uint8 else t.abs().to(dtype)))
    names = [n for n, _ in named]
    dtype_names = [protocol.dtype_name(t.dtype) for _, t in named]
    shapes = [list(t.shape) for _, t in named]
    sizes = packed.declared_nbytes(names, dtype_names, shapes)
    cases = []
    for bound in (1, 40, 100, 1 << 30):
        buffers: list[torch.Tensor] = []
        packed.PackedSender(lambda b, out=buffers: out.append(b.clone()), bound).send([t for _, t in named], sizes)
        cases.append({"bound": bound, "buffers": buffers})
    return [{"named": named, "sizes": sizes, "cases": cases,
             "nccl_update_info": packed.nccl_update_info(names, dtype_names, shapes),
             "nccl_init_info": packed.nccl_init_info(world_size=2, master_address="127.0.0.1", master_port=1234,
                                                     buffer_size_bytes=100),
             "nccl_init_info_uid": packed.nccl_init_info(world_size=2, nccl_unique_id=bytes(range(128))),
             "ipc_update_info": packed.ipc_update_info(names, dtype_names, shapes, sizes,
                                                       {"GPU-test": ("args", 1, torch.Size([3]))}),
             "ipc_init_info": packed.ipc_init_info()}]  # fmt: skip


def test_the_sender_matches_vllms_own_packing_and_unpacking(tmp_path: Path) -> None:
    """vLLM's `pack_tensors` (its nccl producer's packing, which runs on CPU) cuts the same buffers with the
    same bytes; vLLM's `unpack_tensor` (its consumers' unpacking) gives back every tensor bit for bit; vLLM's
    typed infos accept the bodies. The oracle runs in vLLM's environment and imports nothing of ours."""
    python = _vllm_python_or_skip()
    data = tmp_path / "packed.pt"
    torch.save(_cases()[0], data)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the ipc info unpickles its handles only then
    out = subprocess.run([str(python), str(ORACLE), str(data)], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    verdict = json.loads(out.stdout.strip().splitlines()[-1])
    assert verdict["problems"] == [], verdict["problems"]
    # Sizes 30 28 48 2 5 64 4 36 bytes (bf16 15, f32 7, i64 6, f16 1, u8 5, f32 16, f32 1, bf16 18): at
    # bound 40 the buffers are [30 28] [48] [2 5 64] [4 36], at 100 [30 28 48] [2 5 64 4 36].
    assert verdict["buffers"] == {"1": 8, "40": 4, "100": 2, "1073741824": 1}, verdict
    # vLLM's unpack views each piece in place, so a tensor whose offset in its buffer is not a multiple of its
    # itemsize cannot be unpacked: the float32 after 30 bytes of bfloat16, and the float32 after 7 bytes.
    failed = [(bound, k) for bound, k, _ in verdict["unpack_failed"]]
    assert failed == [(40, 0), (40, 2), (100, 0), (100, 1), (1 << 30, 0)], verdict["unpack_failed"]
    assert all("divisible" in why for *_, why in verdict["unpack_failed"])
    assert verdict["checked_tensors"] == 8 + 3  # every tensor at bound 1; [48] and [4 36] at bound 40


def test_vllms_server_imports_this_checkouts_plugin() -> None:
    """The launcher puts `plugin_import_dir()` on the server's PYTHONPATH: vLLM's python then imports this
    checkout's `wsh_vllm_plugin`, whatever copy its environment has installed."""
    python = _vllm_python_or_skip()
    folder = plugin_import_dir()
    here = Path(packed.__file__).resolve().parent
    assert sorted(p.name for p in folder.iterdir()) == ["wsh_vllm_plugin"]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PYTHONPATH"] = str(folder)
    code = "import os, wsh_vllm_plugin; print(os.path.realpath(os.path.dirname(wsh_vllm_plugin.__file__)))"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120, env=env, check=True)
    assert Path(out.stdout.strip()) == here


def test_launchers_in_threads_of_one_process_make_the_plugin_link_together(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A fresh machine has no link yet; a fixture that starts two vLLM servers from threads of one process made
    # it twice under one temp name, and the slower thread's rename found its temp link gone. Both threads are
    # held before their rename until both made their temp link.
    import threading

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    both = threading.Barrier(2, timeout=10)
    rename = Path.replace

    def replace_together(self: Path, target: Path) -> Path:
        both.wait()
        return rename(self, target)

    monkeypatch.setattr(Path, "replace", replace_together)
    with ThreadPoolExecutor(2) as pool:
        folders = list(pool.map(lambda _: plugin_import_dir(), range(2)))
    assert folders[0] == folders[1]
    assert sorted(p.name for p in folders[0].iterdir()) == ["wsh_vllm_plugin"]
    assert (folders[0] / "wsh_vllm_plugin").resolve() == Path(packed.__file__).resolve().parent
