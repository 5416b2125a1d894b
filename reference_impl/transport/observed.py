"""What the trainer's side of a sync observes, as typed records.

These are the types a trainer rank returns across the Ray boundary and the run record stores as they
are (`harness.record` composes them): every HTTP call to the engine with the engine's answer already
turned into data (`Rejection`s), every chunk planned and what became of it, and one rank's report of
one sync. They are pydantic models, so they pickle across processes and round-trip through JSON.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

# What a rejection is about: a tensor name the engine cannot place, its shape, its dtype, its bytes
# (packed size, handle), the update session (none open, already open), a malformed request field,
# or something the engine's answer does not say ("other").
RejectionKind = Literal["name", "shape", "dtype", "bytes", "session", "request", "other"]
REJECTION_KINDS: tuple[str, ...] = ("name", "shape", "dtype", "bytes", "session", "request", "other")
# `SyncReport.names_rejected` reason of every name of a chunk whose rejection named none of its tensors
# (e.g. vLLM's 500 for a wrong shape): it says nothing about which name, if any, was wrong.
GENERIC_REJECTION = "chunk rejected: "


class Rejection(BaseModel):
    """One thing an engine refused in one answer, as data.

    `name` is the HF tensor name the trainer sent (engine-side names such as vLLM module paths are
    mapped back to the sent name where the answer allows it), or the request field / route for a
    rejection that is not about a tensor.
    """

    name: str
    kind: RejectionKind
    reason: str


class HttpCall(BaseModel):
    """One HTTP call from the trainer's engine client to the engine, with the answer as data."""

    route: str
    status: int  # HTTP status; 0 when no response arrived (connection error)
    t: float = 0.0  # unix seconds when the request was sent
    ms: float  # wall milliseconds from request to response
    sync: int | None = None  # sync index, None for calls outside a sync (init, checksum)
    chunk: int | None = None  # chunk index within the sync for /update_weights
    error: str | None = None  # response body (truncated) when status != 200
    rejections: list[Rejection] = Field(default_factory=list)  # the non-200 answer, parsed
    rank: int | None = None  # the trainer rank that made the call, None for the harness's own calls
    engine: int = 0  # the engine replica called (0 .. engines-1; `transport.replicas`)


class TensorLayout(BaseModel):
    """A tensor's shape and dtype name ("float32", "bfloat16", ...), as sent or as a checkpoint holds it."""

    shape: list[int]
    dtype: str

    def __str__(self) -> str:
        return f"{self.shape} {self.dtype}"


class ChunkRecord(BaseModel):
    """One chunk (bucket) of one sync: what was planned, sent and acknowledged."""

    index: int
    names: list[str]  # HF names planned into this chunk, in order
    owners: list[int] = Field(default_factory=list)  # trainer rank that exported each name (0: the sender)
    bytes: int  # planned payload bytes
    sent: bool = False  # the trainer's sender finished its broadcast / handle hand-off
    received: bool = False  # the engine answered 200 to this chunk's /update_weights
    note: str = ""  # why a chunk was not sent, when the sender knows (e.g. the engine ended the session)


class EngineAccount(BaseModel):
    """The sender's account of one engine replica in one sync (`transport.replicas.ReplicaClient`): which
    chunks it answered 200, the names it accepted and refused, its update counts, whether it finished."""

    engine: int
    chunks_received: list[int] = Field(default_factory=list)  # chunk indexes it answered 200
    names_accepted: list[str] = Field(default_factory=list)
    names_rejected: dict[str, str] = Field(default_factory=dict)  # HF name -> its reason (GENERIC_REJECTION)
    engine_update_counts: dict[str, int] = Field(default_factory=dict)  # its /finish_weight_update counts
    finished: bool = False  # its /finish_weight_update answered 200


class SyncReport(BaseModel):
    """What one trainer rank observed in one sync; the sender (global rank 0) fills every field, other
    ranks only `rank`, `phases` and `total_s`. Seconds in `phases` are keyed by phase name (gather,
    convert, transfer, load)."""

    rank: int
    export_mode: str = ""  # export mode that actually ran: "raw" | "bridge"
    chunks_planned: int = 0
    chunks: list[ChunkRecord] = Field(default_factory=list)
    bytes: int = 0  # payload bytes sent in this sync
    phases: dict[str, float] = Field(default_factory=dict)
    total_s: float = 0.0  # wall seconds from the first gather to the engine's finish answer, less `hashing_s`
    hashing_s: float = 0.0  # seconds the hashing of what was sent held the sync up (left out of total_s)
    names_sent: list[str] = Field(default_factory=list)
    names_accepted: list[str] = Field(default_factory=list)
    names_rejected: dict[str, str] = Field(default_factory=dict)  # HF name -> engine's reason (GENERIC_REJECTION)
    sent_checksums: dict[str, str] = Field(default_factory=dict)  # HF name -> checksum of sent bytes
    sent_layout: dict[str, TensorLayout] = Field(default_factory=dict)  # HF name -> shape and dtype sent
    engine_update_counts: dict[str, int] = Field(default_factory=dict)  # engine shard -> updates
    finished: bool = False  # /finish_weight_update answered 200
    # With several engine replicas: the sender's account of each (the fields above then speak of all of
    # them together: a chunk is received when every engine answered 200). Empty with one engine.
    engines: list[EngineAccount] = Field(default_factory=list)
