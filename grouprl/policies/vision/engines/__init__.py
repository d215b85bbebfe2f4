"""Engines that sample text from a vision-language model: base.py (the protocol), fast.py (our
decode loop over the trainer's model), vllm.py (vLLM with multimodal inputs)."""
