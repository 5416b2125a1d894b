"""Model families: real configs, scale-down rules, seeded checkpoints."""
