"""Forward-side pieces of the log-prob parity check.

- `logprobs`: token log-probs and entropies from hidden states and the LM head weight, either with the
  full [T, V] logits (`naive_logprobs`) or in token chunks that never hold them (`fused_logprobs`).
- `prompts`: the fixed prompts (text, and an image prompt for Qwen3-VL families) on which trainer and
  engine log-probs are compared; pure functions of the model config, identical in every process.
- `reference`: the transformers forward over the tensors a sync sent.
- `megatron`: the trainer's own Megatron model forward (pipeline schedule, vocab-parallel fused log-probs).
"""
