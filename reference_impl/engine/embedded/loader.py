"""The embedded engine's strict weight loader over a transformers model.

The engine holds the checkpoint's architecture (built from its `config.json`) filled with its own
seeded dummy weights (`models.hf_model.build_engine_model`), so a sync that moves nothing cannot pass
(README "One scenario", step 3). Its *shards* are checkpoint tensors: one per HF checkpoint name (what
the trainer sends, in the checkpoint's layout), placed into a writable view of a transformers
parameter (`models.checkpoint_views`, by the family's view rules: identity for ordinary parameters,
per-expert slices or a transpose of the fused MoE experts) and spoken of in vLLM terms,
`(vllm_param_name, shard_id)` (`models.vllm_names`, by the family's name table). A tied
`lm_head.weight` is not a shard.

`EngineLoader.load` is stricter than vLLM's `load_weights`: it validates a whole chunk first and
rejects it atomically (nothing copied) when any name cannot be placed, any shape differs from its
shard's, or any dtype differs from the engine's parameter dtype. vLLM raises on unknown names
(`KeyError`/`ValueError` in `qwen2.py`/`utils.py` `AutoWeightsLoader`) but silently skips a tied
`lm_head.weight` and casts other dtypes with only a warning; we report both (README "Verdicts").
A fused expert tensor in the wrong orientation is a shape rejection naming the expected layout (vLLM
would transpose it blindly and fail deep in the expert loader, or load it wrong when dims coincide).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from wsh_vllm_plugin.protocol import DTYPE_NAMES, check_lengths, dtype_name

from reference_impl.checksum import tensor_checksum
from reference_impl.models.checkpoint_views import CheckpointTensor, checkpoint_tensors
from reference_impl.models.families import model_family
from reference_impl.models.hf_model import build_engine_model
from reference_impl.models.vllm_names import VllmTarget, hf_to_vllm, is_vllm_param

KINDS: tuple[str, ...] = ("name", "shape", "dtype")


class LoadRejected(Exception):
    """A chunk the loader refused as a whole; nothing of it was loaded.

    Attributes:
        rejected: HF name -> reason (one sentence saying what was expected).
        kinds: HF name -> "name" | "shape" | "dtype".
    """

    def __init__(self, rejected: dict[str, str], kinds: dict[str, str]) -> None:
        self.rejected = dict(rejected)
        self.kinds = dict(kinds)
        first = next(iter(self.rejected))
        more = f" (and {len(self.rejected) - 1} more rejected tensors)" if len(self.rejected) > 1 else ""
        super().__init__(f"{first}: {self.rejected[first]}{more}; nothing of this chunk was loaded")


@dataclass(frozen=True)
class EngineShard:
    """One engine shard: checkpoint tensor `hf_name` placed at `target` (vLLM name, shard).

    `tensor` says which view of which transformers parameter holds it; `shape` is the checkpoint
    tensor's shape (the view's), `dtype` the parameter's.
    """

    hf_name: str
    target: VllmTarget
    shape: tuple[int, ...]
    dtype: torch.dtype
    tensor: CheckpointTensor

    @property
    def layout(self) -> str:
        """The checkpoint layout the shard expects, in words ("" for a plain parameter)."""
        return self.tensor.layout


class EngineLoader:
    """Strict chunk loader and checksummer over one transformers model.

    Args:
        model: the transformers model whose parameters are the engine's weights.
        model_type: its `model_type` (a key of `models.families.FAMILIES`).

    Raises:
        KeyError: a model_type without a model family.
        RuntimeError: a checkpoint tensor of `model` maps to no vLLM parameter, two map to one shard (the
            name table is out of date with transformers), a view rule is broken, or the model has
            state (buffers) save_pretrained would write that no shard could receive.
    """

    def __init__(self, model: torch.nn.Module, model_type: str) -> None:
        self.model = model
        self.model_type = model_type
        fam = model_family(model_type)
        self.names = fam.names  # vLLM name rules (`models.vllm_names`)
        self.params: dict[str, torch.nn.Parameter] = dict(model.named_parameters())  # deduplicated
        state = model.state_dict(keep_vars=True)
        # Names save_pretrained would write an alias for (the same Parameter under a second name).
        self.tied: dict[str, str] = {
            n: self.names.tied_aliases.get(n, "another parameter")
            for n, t in state.items()
            if isinstance(t, torch.nn.Parameter) and n not in self.params
        }
        unsent = [n for n, t in state.items() if not isinstance(t, torch.nn.Parameter)]
        if unsent:
            raise RuntimeError(f"{model_type} model has buffers in its state dict that no shard receives: {unsent[:3]}")
        self.shards: dict[str, EngineShard] = {}
        seen: dict[VllmTarget, str] = {}
        for hf_name, ct in checkpoint_tensors(fam.views, self.params).items():
            target = hf_to_vllm(self.names, hf_name)
            if not is_vllm_param(self.names, target.name):
                raise RuntimeError(f"{hf_name} maps to {target.name}, which is not a {model_type} vLLM parameter")
            if target in seen:
                raise RuntimeError(f"{hf_name} and {seen[target]} both map to shard {target.key}")
            seen[target] = hf_name
            p = self.params[ct.param]
            self.shards[hf_name] = EngineShard(hf_name, target, tuple(ct.view(p).shape), p.dtype, ct)
        # vLLM parameter name -> its shards, for messages about names that map to a shard the engine lacks.
        self.by_param: dict[str, list[EngineShard]] = {}
        for shard in self.shards.values():
            self.by_param.setdefault(shard.target.name, []).append(shard)
        self.counts: dict[str, int] = {}
        self.reset_counts()

    @classmethod
    def from_checkpoint(cls, checkpoint: Path, seed: int) -> EngineLoader:
        """A loader over `checkpoint`'s architecture with dummy weights of `seed` (`build_engine_model`)."""
        model, model_type = build_engine_model(checkpoint, seed)
        return cls(model, model_type)

    def shard_ids(self) -> list[str]:
        """Every shard as `vllm_name[shard]` (or `vllm_name`), in the model's parameter order."""
        return [s.target.key for s in self.shards.values()]

    def reset_counts(self) -> None:
        """Set every shard's update count to 0 (at the start of an update session)."""
        self.counts = dict.fromkeys(self.shard_ids(), 0)

    def validate(
        self, names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> tuple[dict[str, str], dict[str, str]]:
        """Check a chunk's declared metadata against the shards; loads nothing.

        Returns:
            (rejected, kinds): HF name -> reason and HF name -> "name" | "shape" | "dtype"; both empty
            when every tensor can be placed. A name is judged once, by its first failing check.

        Raises:
            ValueError (`protocol.ProtocolError`): the three lists differ in length.
        """
        rejected: dict[str, str] = {}
        kinds: dict[str, str] = {}

        def reject(name: str, kind: str, reason: str) -> None:
            if name not in rejected:
                rejected[name], kinds[name] = reason, kind

        check_lengths(names, dtype_names, shapes)
        for name, dname, shape in zip(names, dtype_names, shapes, strict=True):
            shard = self.shards.get(name)
            if name in self.tied:
                reject(
                    name,
                    "name",
                    f"tied to {self.tied[name]} (tie_word_embeddings) so it is not an engine parameter; "
                    "vLLM would skip it silently; do not send it, send the embedding only",
                )
            elif shard is None:
                reject(name, "name", self._unknown_name_reason(name))
            elif dname not in DTYPE_NAMES:
                reject(name, "dtype", f"unknown dtype name {dname!r}; expected {dtype_name(shard.dtype)!r}")
            elif DTYPE_NAMES[dname] != shard.dtype:
                reject(
                    name,
                    "dtype",
                    f"declared dtype {dname} but the engine parameter {shard.target.key} is "
                    f"{dtype_name(shard.dtype)}; send {dtype_name(shard.dtype)}",
                )
            elif tuple(int(d) for d in shape) != shard.shape:
                reject(name, "shape", self._shape_reason(shard, shape))
        return rejected, kinds

    def _unknown_name_reason(self, name: str) -> str:
        target = hf_to_vllm(self.names, name)
        known = self.by_param.get(target.name)
        if not known:
            return (
                f"not a {self.model_type} checkpoint parameter of this engine (maps to vLLM name {target.name}, "
                "which the engine has no shard for); send HF checkpoint names"
            )
        first, last = known[0], known[-1]
        return (
            f"not a {self.model_type} checkpoint tensor of this engine: it maps to vLLM shard {target.key}, but the "
            f"engine fills {target.name} from {len(known)} checkpoint tensor(s), {first.hf_name} "
            f"[{first.target.shard}]" + (f" .. {last.hf_name} [{last.target.shard}]" if len(known) > 1 else "")
        )

    @staticmethod
    def _shape_reason(shard: EngineShard, shape: Sequence[int]) -> str:
        got = [int(d) for d in shape]
        layout = f" ({shard.layout})" if shard.layout else ""
        reason = f"shape {got} but the engine shard {shard.target.key} expects {list(shard.shape)}{layout}"
        if len(got) >= 2 and got[:-2] + got[-2:][::-1] == list(shard.shape):
            reason += "; the last two dims are swapped (the other orientation): transpose them before sending"
        return reason

    def load(
        self,
        names: Sequence[str],
        dtype_names: Sequence[str],
        shapes: Sequence[Sequence[int]],
        tensors: Sequence[torch.Tensor],
    ) -> None:
        """Validate one chunk as a whole, then copy every tensor into its parameter and count the shard.

        Each tensor is copied into its shard's view of a transformers parameter (see `models.checkpoint_views`).

        Args:
            names: HF checkpoint names, in chunk order.
            dtype_names: declared dtypes ("float32", "bfloat16", ...), one per name.
            shapes: declared shapes, one per name.
            tensors: the received tensors, one per name (their real dtype/shape is checked too).

        Raises:
            LoadRejected: any tensor cannot be placed; nothing was loaded.
            ValueError: the four lists differ in length.
        """
        rejected, kinds = self.validate(names, dtype_names, shapes)
        if len(tensors) != len(names):
            raise ValueError(f"{len(tensors)} tensors for {len(names)} names")
        for name, t in zip(names, tensors, strict=True):
            shard = self.shards.get(name)
            if shard is None or name in rejected:
                continue
            if t.dtype != shard.dtype:
                rejected[name], kinds[name] = (
                    f"received {dtype_name(t.dtype)} data but the engine parameter is {dtype_name(shard.dtype)}",
                    "dtype",
                )
            elif tuple(t.shape) != shard.shape:
                rejected[name], kinds[name] = "received " + self._shape_reason(shard, t.shape), "shape"
        if rejected:
            raise LoadRejected(rejected, kinds)
        with torch.no_grad():
            for name, t in zip(names, tensors, strict=True):
                shard = self.shards[name]
                self.view(shard).copy_(t)
                self.counts[shard.target.key] += 1

    def view(self, shard: EngineShard) -> torch.Tensor:
        """The writable view of the engine's parameter that holds `shard`'s checkpoint tensor."""
        return shard.tensor.view(self.params[shard.tensor.param])

    def checksums(self) -> dict[str, str]:
        """Checkpoint name -> `tensor_checksum` of every shard, over its view made contiguous.

        In checkpoint names and layout: equal, bit for bit, to the checksums of the checkpoint's
        safetensors tensors after a full sync of them (tied aliases are no shards and not listed).
        """
        return {n: tensor_checksum(self.view(shard)) for n, shard in self.shards.items()}

    def reset_weights(self) -> None:
        """Zero every parameter (vLLM `/weight_checker {"action": "reset"}`)."""
        with torch.no_grad():
            for p in self.params.values():
                p.zero_()

    def total_bytes(self) -> int:
        """Bytes of all shards (what one full sync moves)."""
        return sum(math.prod(s.shape) * torch.empty((), dtype=s.dtype).element_size() for s in self.shards.values())
