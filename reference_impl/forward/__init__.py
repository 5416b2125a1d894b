"""Forward-side pieces of the log-prob parity check (README "One scenario", step 6).

- `logprobs`: token log-probs and entropies from hidden states and the LM head weight, either with the
  full [T, V] logits (`naive_logprobs`) or in token chunks that never hold them (`fused_logprobs`).
- `prompts`: the fixed prompts (text, and an image prompt for Qwen3-VL families) on which trainer and
  engine log-probs are compared; pure functions of the model config, identical in every process.
- `reference`: the trainer-side forward over the tensors a sync sent, built from `models/` (the
  transformers model of the checkpoint and the family's checkpoint views), never from engine code.
"""
