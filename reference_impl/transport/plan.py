"""The chunk (bucket) plan of one sync, computed identically on every trainer rank.

Tensors are taken in a fixed order (owner rank, then the owner's export order) and packed greedily:
a chunk is closed before a tensor that would take it past `chunk_bytes`; a tensor larger than the
bucket travels alone. `chunk_bytes=1` gives one tensor per chunk; a bucket at least the model's size
gives one chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TensorMeta:
    """One HF tensor to send: name, shape, dtype name (vLLM spelling), bytes, owning trainer rank."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    owner: int


@dataclass(frozen=True)
class Chunk:
    """One chunk: its index in the sync and its tensors in packing order."""

    index: int
    tensors: tuple[TensorMeta, ...] = field(default_factory=tuple)

    @property
    def nbytes(self) -> int:
        """Payload bytes of the chunk."""
        return sum(t.nbytes for t in self.tensors)

    def owners(self) -> set[int]:
        """Ranks that contribute tensors to this chunk."""
        return {t.owner for t in self.tensors}


def plan_chunks(tensors: Sequence[TensorMeta], chunk_bytes: int) -> list[Chunk]:
    """Greedy chunk plan (see module doc).

    Raises:
        ValueError: `chunk_bytes` < 1, or a name appears twice (two ranks own the same tensor).
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    seen: dict[str, int] = {}
    for t in tensors:
        if t.name in seen:
            raise ValueError(f"{t.name} is named by ranks {seen[t.name]} and {t.owner}; exactly one must send it")
        seen[t.name] = t.owner
    chunks: list[list[TensorMeta]] = []
    size = 0
    for t in tensors:
        if chunks and chunks[-1] and size + t.nbytes <= chunk_bytes:
            chunks[-1].append(t)
            size += t.nbytes
        else:
            chunks.append([t])
            size = t.nbytes
    return [Chunk(i, tuple(c)) for i, c in enumerate(chunks)]
