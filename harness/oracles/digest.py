"""The oracles' own digests: XXH3-128 of a tensor's row-major bytes, computed apart from the system under
test's `reference_impl.checksum`.

The engine and the sender report `reference_impl.checksum.tensor_checksum` digests; the oracles (the
checkpoint, the expected state, a fresh engine, vLLM's TP partition) compute theirs here, so a checksum of
the system under test that hashed less than every byte (a sample "for speed", one dtype's bytes read as
another's) disagrees with every oracle instead of agreeing with itself. When both are right they give one
hex digest for the same bytes: XXH3-128 (the `xxhash` package), 32 lowercase hex characters, over a
tensor's contiguous row-major bytes in its own dtype, without its shape or dtype.

- `tensor_digest`: a tensor in memory (any dtype, any device), through its flat byte view.
- `checkpoint_digests`: every tensor of a safetensors checkpoint, straight from the files' bytes (the
  header's `data_offsets`, safetensors' format: an 8-byte little-endian header length, the JSON header, then
  the data), with no tensor built.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch
import xxhash


def tensor_digest(t: torch.Tensor) -> str:
    """XXH3-128 hex digest (32 characters) of `t`'s row-major bytes in its own dtype; a 0-element tensor
    digests the empty byte string."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    hasher = xxhash.xxh3_128()
    if flat.numel():
        hasher.update(memoryview(flat.view(torch.uint8).numpy()))
    return hasher.hexdigest()


def checkpoint_digests(path: Path) -> dict[str, str]:
    """HF name -> XXH3-128 hex digest of that tensor's bytes in the checkpoint folder `path`
    (`*.safetensors`), read from the files themselves.

    Raises:
        ValueError: a file whose header is not a safetensors header, or whose offsets lie outside its data.
    """
    out: dict[str, str] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            (header_len,) = struct.unpack("<Q", data[:8])
            try:
                header = json.loads(data[8 : 8 + header_len])
            except ValueError as e:
                raise ValueError(f"{f}: no safetensors header ({e})") from None
            base = 8 + header_len
            view = memoryview(data)
            try:
                for name, entry in header.items():
                    if name == "__metadata__":
                        continue
                    start, end = entry["data_offsets"]
                    if not 0 <= start <= end <= len(data) - base:
                        raise ValueError(f"{f}: {name!r} has data offsets {start}..{end} outside its data")
                    out[name] = xxhash.xxh3_128_hexdigest(view[base + start : base + end])
            finally:
                view.release()
    return out
