"""HF checkpoint facts, the bottom layer of reference_impl: it imports no other package of it.

Model entries and scale-down rules (`registry`), the seeded checkpoint maker (`checkpoint`), the
transformers model of a checkpoint folder (`hf_model`), released weights in a local HF cache
(`hf_cache`), the rule engines for raw conversion (`raw_rules`), vLLM names (`vllm_names`) and
checkpoint views (`checkpoint_views`), and one file per model family (`families/`, `family.ModelFamily`).
"""
