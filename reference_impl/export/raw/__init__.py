"""Raw (hand-written) Megatron -> HF converters: one rule table per model family."""

from reference_impl.export.raw import qwen3, qwen3_vl
from reference_impl.export.raw.rules import Rule

TABLES: dict[str, list[Rule]] = {"qwen3": qwen3.RULES, "qwen3_vl": qwen3_vl.RULES}
