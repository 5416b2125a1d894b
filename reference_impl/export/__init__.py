"""Megatron -> HF export, as an RL framework runs it after every step: `raw` (our rule tables) or
`bridge` (Megatron-Bridge's `export_hf_weights`, per PP stage: `bridge.py`); `stream.export(mode, ...)` dispatches."""

MODES: tuple[str, ...] = ("raw", "bridge")
