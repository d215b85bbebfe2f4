"""Text generation backends: `fast` (grouprl's own decode loop, the default), `hf` (transformers
generate) and `vllm` (an in-process vllm.LLM; imported lazily, only when configured).

Every engine takes prompt token ids and `SamplingParams` and returns `GenerationOutput`
(completion token ids + the log-prob of each sampled token under its sampling distribution).
"""

from grouprl.rollouts.engines.base import GenerationOutput, SamplingParams, TextEngine
from grouprl.rollouts.engines.fast import FastEngine
from grouprl.rollouts.engines.hf import HFEngine

__all__ = ["FastEngine", "GenerationOutput", "HFEngine", "SamplingParams", "TextEngine"]
