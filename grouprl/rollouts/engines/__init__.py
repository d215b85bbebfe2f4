"""Text generation backends: `hf` (transformers generate, the default) and, later, `vllm`.

Every engine takes prompt token ids and `SamplingParams` and returns `GenerationOutput`
(completion token ids + the log-prob of each sampled token under its sampling distribution).
"""

from grouprl.rollouts.engines.base import GenerationOutput, SamplingParams, TextEngine
from grouprl.rollouts.engines.hf import HFEngine

__all__ = ["GenerationOutput", "HFEngine", "SamplingParams", "TextEngine"]
