"""Run by vLLM's python (`tests/test_vllm_packed.py`): judge the trainer's packed-format output with vLLM's
own code. Imports nothing of the harness or of wsh_vllm_plugin.

Usage: python vllm_env_packed_oracle.py DATA.pt   (DATA from `test_vllm_packed._cases`)

For every bound: vLLM's `pack_tensors` (the packing of its nccl producer) over the same named tensors must
cut the same buffers with the same bytes; vLLM's `unpack_tensor` (its consumers' unpacking) over each of
the trainer's buffers, with sizes computed as vLLM's consumer computes them (prod(shape) * itemsize of
`getattr(torch, dtype_name)`), must give back every tensor bit for bit, or fail (vLLM's views need every
tensor's offset to be a multiple of its itemsize; the format has no padding): failures are reported.
vLLM's typed infos (nccl init and update, ipc init and update) must accept the trainer's bodies and read
the same values back. Prints one JSON line: {"buffers": {bound: count}, "checked_tensors": n,
"unpack_failed": [[bound, index, error]], "problems": [...]}.
"""

from __future__ import annotations

import json
import math
import sys

import torch
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
from vllm.distributed.weight_transfer.packed_tensor import pack_tensors, unpack_tensor


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def main(path: str) -> dict[str, object]:
    data = torch.load(path, weights_only=False)
    named: list[tuple[str, torch.Tensor]] = data["named"]
    original = dict(named)
    problems: list[str] = []
    counts: dict[str, int] = {}
    unpack_failed: list[list[object]] = []
    checked = 0
    upd = NCCLWeightTransferUpdateInfo(**data["nccl_update_info"])
    dtypes = {n: getattr(torch, d) for n, d in zip(upd.names, upd.dtype_names, strict=True)}
    shapes = dict(zip(upd.names, upd.shapes, strict=True))
    if upd.names != [n for n, _ in named]:
        problems.append(f"update_info names {upd.names} are not the tensors' order")
    for case in data["cases"]:
        bound, ours = case["bound"], case["buffers"]
        theirs = []
        it = iter(named)
        while (chunk := pack_tensors(it, lambda item: item[1], bound)) is not None:
            theirs.append(chunk)
        counts[str(bound)] = len(ours)
        if len(theirs) != len(ours):
            problems.append(f"bound {bound}: vLLM packs {len(theirs)} buffers, the trainer sent {len(ours)}")
            continue
        for k, (chunk, buf) in enumerate(zip(theirs, ours, strict=True)):
            if not torch.equal(chunk.packed_tensor, buf):
                problems.append(f"bound {bound} buffer {k}: bytes differ from vLLM's pack_tensors")
            sizes = [math.prod(shapes[n]) * dtypes[n].itemsize for n in chunk.names]
            try:
                got = unpack_tensor(
                    buf, chunk.names, [shapes[n] for n in chunk.names], [dtypes[n] for n in chunk.names], sizes
                )
            except RuntimeError as e:  # vLLM's views need offsets divisible by each dtype's itemsize
                unpack_failed.append([bound, k, str(e)[:200]])
                continue
            for name, tensor in got:
                checked += 1
                want = original[name]
                if tensor.dtype != want.dtype or list(tensor.shape) != list(want.shape):
                    problems.append(f"bound {bound}: {name} unpacks as {tensor.dtype} {list(tensor.shape)}")
                elif not torch.equal(_bits(tensor), _bits(want)):
                    problems.append(f"bound {bound}: {name} unpacks to other bits")
    init = NCCLWeightTransferInitInfo(**data["nccl_init_info"])
    if (init.master_address, init.master_port, init.rank_offset, init.world_size) != ("127.0.0.1", 1234, 1, 2):
        problems.append(f"nccl init_info read back as {init}")
    if not init.packed or init.packed_buffer_size_bytes != 100 or init.nccl_unique_id_bytes is not None:
        problems.append(f"nccl init_info packed fields read back as {init}")
    by_uid = NCCLWeightTransferInitInfo(**data["nccl_init_info_uid"])
    if by_uid.nccl_unique_id_bytes != bytes(range(128)) or by_uid.master_address is not None:
        problems.append("nccl init_info with a unique id does not decode to the 128 bytes sent")
    ipc = IPCWeightTransferUpdateInfo(**data["ipc_update_info"])
    if ipc.ipc_handles != {"GPU-test": ("args", 1, torch.Size([3]))}:
        problems.append(f"ipc handles read back as {ipc.ipc_handles!r}")
    if ipc.tensor_sizes != data["sizes"] or ipc.names != upd.names:
        problems.append(f"ipc tensor_sizes {ipc.tensor_sizes} != the declared sizes {data['sizes']}")
    if not IPCWeightTransferInitInfo(**data["ipc_init_info"]).packed:
        problems.append("ipc init_info is not packed")
    return {"buffers": counts, "checked_tensors": checked, "unpack_failed": unpack_failed, "problems": problems}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
