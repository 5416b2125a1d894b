"""Model entries: a real Hugging Face config plus a scale-down rule, read from `scenarios/models/`.

An entry (`scenarios/models/<name>.yaml`) names its `model_type` (a key of `models.families.FAMILIES`:
`qwen3`, `qwen3_vl`, `qwen3_moe`, `qwen3_vl_moe`), a real config.json
copied from the published model (sources in `scenarios/models/SOURCES.md`) and a `scale_down`
mapping of config overrides (nested for `text_config` / `vision_config`), or null for the real size.
An entry with `hf_repo` (scale_down null) is served from the released weights in a local Hugging Face
cache (`models.hf_cache`; the GPU matrix). `ModelSpec.model_config()` exposes the numbers scenario
validation needs (heads, layers, ...), and
`check_scale_down_keeps_facts` asserts that a scaled model keeps the architecture's facts.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from reference_impl.models.families import FAMILIES, model_family

REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS_DIR = REPO_ROOT / "scenarios" / "models"


class ModelEntryError(ValueError):
    """A model entry that cannot be used; the message says what to change."""


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "rope_scaling":
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


@dataclass(frozen=True)
class ModelConfig:
    """Architecture numbers of the text model (and vision tower) that validation and converters use."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    vision_depth: int = 0
    vision_hidden: int = 0
    vision_heads: int = 0
    deepstack_indexes: tuple[int, ...] = ()
    num_experts: int = 0  # 0 = dense
    experts_per_token: int = 0
    moe_ffn_hidden_size: int = 0
    sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelSpec:
    """One model entry with its scale-down applied: `config` is the HF config.json dict to build."""

    name: str
    model_type: str  # transformers config.model_type, a key of `models.families.FAMILIES`
    hf_architecture: str
    source_config: dict[str, Any]
    config: dict[str, Any]
    scaled: bool
    changes: tuple[str, ...] = ()  # facts of the real model this entry changes on purpose
    hf_repo: str | None = None  # released weights from the local HF cache (`models.hf_cache`), not seeded
    # The trainer pads its vocabulary as Megatron-LM does by default (`megatron_pad_vocab: true`): the export
    # must drop the padding rows, and the trainer's log-probs must leave their columns out.
    pad_vocab: bool = False

    @property
    def is_vl(self) -> bool:
        """A vision-language family (config has text_config / vision_config)."""
        return model_family(self.model_type).is_vl

    @property
    def is_moe(self) -> bool:
        """A mixture-of-experts family."""
        return self.model_config().num_experts > 0

    def text_config(self) -> dict[str, Any]:
        """The text model's config dict (top level for Qwen3, `text_config` for Qwen3-VL)."""
        return self.config["text_config"] if self.is_vl else self.config

    def model_config(self) -> ModelConfig:
        """Numbers read from `config` (see `ModelConfig`)."""
        t = self.text_config()
        v = self.config.get("vision_config", {})
        return ModelConfig(
            hidden_size=t["hidden_size"],
            num_layers=t["num_hidden_layers"],
            num_heads=t["num_attention_heads"],
            num_kv_heads=t["num_key_value_heads"],
            head_dim=t.get("head_dim", t["hidden_size"] // t["num_attention_heads"]),
            ffn_hidden_size=t["intermediate_size"],
            vocab_size=t["vocab_size"],
            tied_embeddings=bool(self.config.get("tie_word_embeddings", t.get("tie_word_embeddings", False))),
            vision_depth=v.get("depth", 0),
            vision_hidden=v.get("hidden_size", 0),
            vision_heads=v.get("num_heads", 0),
            deepstack_indexes=tuple(v.get("deepstack_visual_indexes", ())),
            num_experts=t.get("num_experts", 0) or 0,
            experts_per_token=t.get("num_experts_per_tok", 0) or 0,
            moe_ffn_hidden_size=t.get("moe_intermediate_size", 0) or 0,
            sparse_step=t.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(t.get("mlp_only_layers", ()) or ()),
        )


def available_models() -> list[str]:
    """Names of the entries under `scenarios/models/`."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.yaml"))


def load_model(name: str, models_dir: Path = MODELS_DIR) -> ModelSpec:
    """Read entry `name`, apply its scale-down rule.

    Raises:
        ModelEntryError: unknown name or model_type, missing config file.
    """
    path = models_dir / f"{name}.yaml"
    if not path.exists():
        raise ModelEntryError(
            f"unknown model {name!r}: add scenarios/models/{name}.yaml or use one of {available_models()}"
        )
    entry = yaml.safe_load(path.read_text())
    if "base" in entry:  # a variant: the base entry with this entry's fields and scale-down on top
        base = yaml.safe_load((models_dir / f"{entry['base']}.yaml").read_text())
        rule = _merge(base.get("scale_down") or {}, entry.get("scale_down") or {})
        entry = {**base, **entry, "scale_down": rule}
    if entry.get("hf_repo") and entry.get("scale_down"):
        raise ModelEntryError(f"{path.name}: an entry with hf_repo serves the released weights: set scale_down: null")
    if entry.get("model_type") not in FAMILIES:
        raise ModelEntryError(f"{path.name}: model_type must be one of {tuple(FAMILIES)}, got {entry.get('family')!r}")
    cfg_path = models_dir / entry["config"]
    if not cfg_path.exists():
        raise ModelEntryError(f"{path.name}: config file {cfg_path.name} not found beside it")
    source = json.loads(cfg_path.read_text())
    rule = entry.get("scale_down")
    config = _merge(source, rule) if rule else copy.deepcopy(source)
    if model_family(entry["model_type"]).is_vl:
        # The vision tower projects into the text model's width.
        config["vision_config"]["out_hidden_size"] = config["text_config"]["hidden_size"]
    return ModelSpec(
        name=entry["name"],
        model_type=entry["model_type"],
        hf_architecture=entry["hf_architecture"],
        source_config=source,
        config=config,
        scaled=bool(rule),
        changes=tuple(entry.get("changes", ())),
        hf_repo=entry.get("hf_repo"),
        pad_vocab=bool(entry.get("megatron_pad_vocab", False)),
    )


def check_scale_down_keeps_facts(spec: ModelSpec) -> list[str]:
    """Facts of the real architecture that the scaled config lost; empty when all are kept.

    Kept facts: GQA ratio, head_dim >= 32 and in vLLM's CPU attention set, q/k norm (implied by the
    family), tied embeddings as the real model has them, hidden != heads*head_dim when the real model
    has it so; then the family's own `scale_down_checks` (`models/families/`): for Qwen3-VL also
    patch/temporal/merge sizes, a square position grid, mRoPE sections in the real proportion summing
    to head_dim/2, vision depth >= 2 holding every deepstack index; for the MoE families the expert
    count, experts per token, expert width ratio and dense/sparse layer pattern.

    Raises:
        KeyError: `spec.model_type` is not a registered family.
    """
    problems: list[str] = []
    real = ModelSpec(spec.name, spec.model_type, spec.hf_architecture, spec.source_config, spec.source_config, False)
    kept = set(spec.changes)
    f, r = spec.model_config(), real.model_config()
    if f.num_heads * r.num_kv_heads != r.num_heads * f.num_kv_heads:
        problems.append(f"GQA ratio {f.num_heads}:{f.num_kv_heads} differs from real {r.num_heads}:{r.num_kv_heads}")
    if f.head_dim not in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512):
        problems.append(f"head_dim {f.head_dim} is not one vLLM's CPU attention supports")
    if f.tied_embeddings != r.tied_embeddings and "tie_word_embeddings" not in kept:
        problems.append(f"tie_word_embeddings {f.tied_embeddings} differs from real {r.tied_embeddings}")
    if (r.hidden_size == r.num_heads * r.head_dim) != (f.hidden_size == f.num_heads * f.head_dim):
        problems.append("hidden_size vs heads*head_dim relation differs from the real model")
    for check in model_family(spec.model_type).scale_down_checks:
        problems.extend(check(spec, real))
    return problems
