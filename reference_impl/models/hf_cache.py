"""Released weights from a local Hugging Face cache, for the full-size GPU matrix.

A model entry with `hf_repo: Qwen/Qwen3-4B` is served from the released checkpoint instead of a
seeded one. Where it is looked up: `$WSH_HF_CACHE`, a folder that is either a Hugging Face hub cache
(`models--Qwen--Qwen3-4B/snapshots/<revision>/`, as `huggingface-cli download` leaves it under
`$HF_HOME/hub`) or a folder of plain model folders (`Qwen3-4B/` or `Qwen--Qwen3-4B/`). A usable folder
holds `config.json` and at least one `*.safetensors` file.
"""

from __future__ import annotations

import os
from pathlib import Path

HF_CACHE_ENV = "WSH_HF_CACHE"


class WeightsMissing(FileNotFoundError):
    """No local copy of a model's released weights (the message says where it looked and what to set)."""


def _usable(folder: Path) -> bool:
    return (folder / "config.json").exists() and any(folder.glob("*.safetensors"))


def find_snapshot(hf_repo: str, cache: str | None = None) -> Path:
    """The folder holding `hf_repo`'s released config.json and safetensors.

    Raises:
        WeightsMissing: `$WSH_HF_CACHE` unset, or no usable folder for `hf_repo` under it.
    """
    root = cache or os.environ.get(HF_CACHE_ENV)
    if not root:
        raise WeightsMissing(
            f"{hf_repo} is read from released weights: set {HF_CACHE_ENV} to a Hugging Face hub cache (or a folder "
            "of model folders) that holds it"
        )
    base = Path(root)
    org, _, name = hf_repo.partition("/")
    snapshots = sorted(
        (base / f"models--{org}--{name}" / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime, reverse=True
    )
    for cand in [*snapshots, base / name, base / f"{org}--{name}", base / hf_repo]:
        if _usable(cand):
            return cand
    raise WeightsMissing(
        f"{hf_repo} not found under {HF_CACHE_ENV}={base}: expected models--{org}--{name}/snapshots/<rev>/ or "
        f"{name}/ with config.json and *.safetensors (`huggingface-cli download {hf_repo} --cache-dir {base}` puts "
        "it there)"
    )
