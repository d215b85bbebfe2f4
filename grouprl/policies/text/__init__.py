"""Text policies: causal LMs (transformers), their loading, LoRA, log-probs and engines."""
