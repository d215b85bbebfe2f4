"""Text generation backends: `fast` (grouprl's own decode loop, the default), `hf` (transformers
generate) and `vllm` (an in-process vllm.LLM; imported lazily, only when configured).

Every engine takes prompt token ids and `SamplingParams` and returns `GenerationOutput`
(completion token ids + the log-prob of each sampled token under its sampling distribution).
"""

from grouprl.policies.text.engines.base import GenerationOutput, SamplingParams, TextEngine
from grouprl.policies.text.engines.fast import FastEngine
from grouprl.policies.text.engines.hf import HFEngine

__all__ = ["FastEngine", "GenerationOutput", "HFEngine", "SamplingParams", "TextEngine"]
