"""Forward-side pieces of the log-prob parity check (README "One scenario", step 6).

- `logprobs`: token log-probs and entropies from hidden states and the LM head weight, either with the
  full [T, V] logits (`naive_logprobs`) or in token chunks that never hold them (`fused_logprobs`).
- `prompts`: the fixed prompts (text, and an image prompt for Qwen3-VL families) on which trainer and
  engine log-probs are compared; pure functions of the model config, identical in every process.
- `megatron`: the trainer's own log-probs: its Megatron model's forward (pipeline schedule,
  vocab-parallel fused log-probs), collectively on every trainer rank.
- `hf`: the transformers forward of a checkpoint's architecture over given HF tensors (the harness runs it
  over the expected state as a third view), built from `models/`, never from engine code.
"""
