"""Seeded random checkpoints on the real architecture, written by transformers as safetensors.

The checkpoint is the ground truth of sync #0. It is made once per (config, seed, dtype) and cached
under `<cache>/checkpoints/<model>-<hash>/`; the hash covers the config dict, the seed and the dtype,
so a changed scale-down rule makes a new checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from reference_impl.models.families import model_family
from reference_impl.models.registry import REPO_ROOT, ModelSpec
from reference_impl.models.tokenizer import write_processor_files

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_root() -> Path:
    """Cache folder: `$WSH_CACHE` or `<repo>/.cache`."""
    return Path(os.environ.get("WSH_CACHE", REPO_ROOT / ".cache"))


# Bumped whenever the maker writes different bytes or files for the same inputs (v2: released VL-MoE layout;
# v3: VL checkpoints carry a tokenizer, chat template and image/video processor configs).
MAKER_VERSION = 3


def config_hash(config: dict[str, Any], seed: int, dtype: str) -> str:
    """sha256 (first 12 hex digits) of the canonical JSON of config, seed, dtype and MAKER_VERSION."""
    blob = json.dumps({"config": config, "seed": seed, "dtype": dtype, "maker": MAKER_VERSION}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def hf_config(spec: ModelSpec, dtype: str):
    """A transformers config object for `spec.config` (architecture from the entry)."""
    from transformers import AutoConfig

    cfg = dict(spec.config)
    cfg["architectures"] = [spec.hf_architecture]
    cfg.pop("transformers_version", None)
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = dtype
    for sub in ("text_config", "vision_config"):
        if sub in cfg:
            cfg[sub] = {**cfg[sub], "dtype": dtype}
    model_type = cfg.pop("model_type")
    return AutoConfig.for_model(model_type, **cfg)


def build_hf_model(spec: ModelSpec, dtype: str, seed: int | None):
    """A transformers model of `spec` in `dtype`; with `seed`, every tensor is filled deterministically.

    Fill rule (seeded generator, tensors in `named_parameters` order): 1-D tensors (norm weights,
    biases) 1 + N(0, 0.1) for norms / N(0, 0.02) for biases, others N(0, 0.02). Norms away from 1 make a
    sync that moves nothing visible in checksums.
    """
    import transformers
    from transformers.initialization import no_init_weights

    cfg = hf_config(spec, dtype)
    cls = getattr(transformers, spec.hf_architecture)
    torch_dtype = DTYPES[dtype]
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        # Without transformers' own initialisation (about half of a 0.6B model's build on CPU): the seeded
        # fill below, or the caller's load, writes every parameter. Buffers (rotary inv_freq) are computed
        # in __init__ and kept; the skipped `init_weights` is also what ties a tied lm_head, so that is done.
        with no_init_weights():
            model = cls(cfg)
        model.tie_weights()
    finally:
        torch.set_default_dtype(prev)
    model.eval()
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
                if p.ndim == 1 and "norm" in name:
                    p.copy_((1.0 + 0.1 * noise).to(p.dtype))
                else:
                    p.copy_((0.02 * noise).to(p.dtype))
    return model


_FUSED_EXPERT_SUFFIXES = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def to_released_expert_layout(folder: Path) -> None:
    """Rewrite Qwen3-VL-MoE fused expert tensors in `folder` into the released checkpoints' layout.

    transformers 5.12.1 `save_pretrained` writes its in-memory layout, `mlp.experts.gate_up_proj`
    [E, 2*moe_inter, hidden] and `mlp.experts.down_proj` [E, hidden, moe_inter]; the published
    Qwen3-VL-30B-A3B checkpoints (and vLLM's `qwen3_vl_moe.py`, which transposes unconditionally) use
    [E, hidden, 2*moe_inter] (gate first along the last dim) and [E, moe_inter, hidden]. transformers
    loads either. The maker writes the released layout so the ground truth matches what vLLM loads
    (for the families with `ModelFamily.released_fused_experts`).
    """
    from safetensors.torch import load_file, save_file

    for f in sorted(folder.glob("*.safetensors")):
        tensors = load_file(f)
        changed = {n: t.transpose(1, 2).contiguous() for n, t in tensors.items() if n.endswith(_FUSED_EXPERT_SUFFIXES)}
        if changed:
            save_file({**tensors, **changed}, f, metadata={"format": "pt"})


def make_checkpoint(spec: ModelSpec, seed: int, dtype: str = "float32", root: Path | None = None) -> Path:
    """Write (once) and return the folder of the seeded checkpoint of `spec`.

    The folder holds `config.json` and `model.safetensors` (or shards) as `save_pretrained` writes them;
    a VL family's checkpoint also its tokenizer, chat template and image/video processor configs
    (`tokenizer.write_processor_files`: what vLLM's chat route needs for the image prompt). Concurrent
    callers are safe: the checkpoint is written to a temp folder and renamed. An entry with `hf_repo` returns
    the released checkpoint's folder instead (`hf_cache.find_snapshot`).

    Raises:
        hf_cache.WeightsMissing: `hf_repo` entry without a local copy of its weights.
    """
    if spec.hf_repo:  # released weights, read where they are (dtype is theirs; seed unused)
        from reference_impl.models.hf_cache import find_snapshot

        return find_snapshot(spec.hf_repo)
    root = root or cache_root()
    out = root / "checkpoints" / f"{spec.name}-{dtype}-{config_hash(spec.config, seed, dtype)}"
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model = build_hf_model(spec, dtype, seed)
    model.save_pretrained(tmp, max_shard_size="20GB")
    family = model_family(spec.model_type)
    if family.released_fused_experts:
        to_released_expert_layout(tmp)
    if family.is_vl:
        write_processor_files(spec.config, tmp)
    (tmp / "wsh_source.json").write_text(json.dumps({"model": spec.name, "seed": seed, "dtype": dtype}))
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    return out


def checkpoint_layout(path: Path) -> dict[str, tuple[list[int], str]]:
    """HF name -> (shape, dtype name) of every tensor of a checkpoint folder, read from the safetensors
    headers only (no tensor data)."""
    from safetensors import safe_open

    out: dict[str, tuple[list[int], str]] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118  (safe_open has no __iter__)
                piece = fh.get_slice(name)
                out[name] = (list(piece.get_shape()), _SAFETENSORS_DTYPES.get(piece.get_dtype(), piece.get_dtype()))
    return out


# safetensors header dtype codes -> torch dtype names (the protocol's spelling)
_SAFETENSORS_DTYPES = {
    "F32": "float32",
    "BF16": "bfloat16",
    "F16": "float16",
    "I64": "int64",
    "I32": "int32",
    "U8": "uint8",
}


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder, by HF name (safetensors, every shard)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out
