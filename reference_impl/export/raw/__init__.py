"""Raw (hand-written) Megatron -> HF converters: one rule table per model family."""

from reference_impl.export.raw import qwen3, qwen3_moe, qwen3_vl, qwen3_vl_moe
from reference_impl.export.raw.rules import FamilyTable

TABLES: dict[str, FamilyTable] = {
    "qwen3": FamilyTable(qwen3.RULES),
    "qwen3_vl": FamilyTable(qwen3_vl.RULES),
    "qwen3_moe": FamilyTable(qwen3_moe.RULES),
    "qwen3_vl_moe": qwen3_vl_moe.TABLE,
}
