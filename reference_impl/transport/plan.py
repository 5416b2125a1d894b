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
    greedy = Greedy(chunk_bytes)
    full = [c for t in tensors if (c := greedy.add(t)) is not None]
    if greedy.pending:
        full.append(tuple(greedy.pending))
    return [Chunk(i, c) for i, c in enumerate(full)]


class Greedy:
    """The plan's greedy rule, one tensor at a time (tensors in plan order): a tensor joins the current chunk
    while the chunk stays within `chunk_bytes`, else it starts the next one. `plan_chunks` runs it over every
    tensor; the sender runs it over its own tensors as its export produces them (`transport.sync`)."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.pending: list[TensorMeta] = []
        self.size = 0

    def add(self, meta: TensorMeta) -> tuple[TensorMeta, ...] | None:
        """Add `meta`; returns the tensors of the chunk completed by it (the ones before it, when it does not
        fit beside them), else None."""
        full = None
        if self.pending and self.size + meta.nbytes > self.chunk_bytes:
            full, self.pending, self.size = tuple(self.pending), [], 0
        self.pending.append(meta)
        self.size += meta.nbytes
        return full
