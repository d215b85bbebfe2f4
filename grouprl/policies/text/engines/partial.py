"""Partial rollouts: generation in chunks of tokens, with the weights refreshed between chunks.

Asynchronous RL systems with a staleness bound (AReaL, arXiv 2505.24298, "interruptible
generation") let new weights reach completions that are still being generated: a long completion
need not finish under the weights it started with. ChunkedEngine wraps any text engine (the
`generate` contract plus `load_weights`): it asks the inner engine for at most `chunk_tokens` new
tokens per row; before each chunk it calls `refresh()`, which may load newer weights into the
inner engine and returns the weight version the next chunk samples with; every unfinished row then
continues with prompt + its tokens so far as the new prompt. Each token keeps the log-prob and the
version that sampled it (GenerationOutput.token_versions): the inner engine's own per-completion
version where it reports one (vllm_server), else refresh()'s.

Deviations from AReaL: AReaL interrupts generation when weights arrive (and discards the KV cache);
here the boundary is a fixed number of tokens, and the new weights wait for the next boundary. A
continued row is re-encoded from its ids (no KV cache across chunks), so with unchanged weights it
is the same greedy continuation as one straight call, up to float round-off of the prefill.
Stop strings are refused (one could span a chunk boundary). Seeded sampling: chunk c > 0 derives
each row's seed from (its seed, c), so the chunks do not replay the first chunk's random stream
(seeded runs are therefore reproducible, but not the same draws as unchunked generation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from grouprl.policies.text.engines.base import GenerationOutput, SamplingParams, TextEngine

SEED_STRIDE = 1_000_003  # chunk c of a row seeded s draws from seed s + c * SEED_STRIDE


class ChunkedEngine:
    """`inner` generating at most `chunk_tokens` tokens per call; `refresh()` runs before every
    chunk and returns the weight version that chunk samples with (see module docstring)."""

    def __init__(self, inner: TextEngine, chunk_tokens: int, refresh: Callable[[], int]) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"ChunkedEngine: chunk_tokens must be >= 1, got {chunk_tokens}")
        self.inner, self.chunk_tokens, self.refresh = inner, chunk_tokens, refresh

    def load_weights(self, weights: Any) -> None:
        self.inner.load_weights(weights)

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        params: SamplingParams,
        *,
        greedy: bool = False,
        seeds: list[int] | None = None,
    ) -> GenerationOutput:
        if params.stop:
            raise ValueError(
                f"partial rollouts (train.partial_chunk_tokens) cannot honour stop strings "
                f"{params.stop!r}: one could span two chunks; drop rollout.stop or the chunking"
            )
        n = len(prompt_token_ids)
        ids: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        versions: list[list[int]] = [[] for _ in range(n)]
        truncated = [False] * n
        active = list(range(n))  # rows still generating; all have the same length so far
        done, chunk = 0, 0  # tokens per active row so far; chunk index
        while active:
            version = int(self.refresh())
            budget = min(self.chunk_tokens, params.max_new_tokens - done)
            more = {}
            if seeds is not None:
                more["seeds"] = [seeds[i] + chunk * SEED_STRIDE for i in active]
            out = self.inner.generate(
                [prompt_token_ids[i] + ids[i] for i in active],
                replace(params, max_new_tokens=budget),
                greedy=greedy,
                **more,
            )
            still = []
            for j, i in enumerate(active):
                got = list(out.completion_ids[j])
                ids[i] += got
                logps[i] += list(out.logprobs[j])
                # an engine that reports the version it sampled with (vllm_server: weights pushed
                # by the trainer, maybe newer than refresh() saw) is believed over refresh()
                got_version = version if out.versions is None else out.versions[j]
                versions[i] += [got_version] * len(got)
                if out.truncated[j] and len(got) == budget:  # used the chunk: maybe more to come
                    if done + budget >= params.max_new_tokens:
                        truncated[i] = True  # the whole budget without stopping
                    else:
                        still.append(i)
            active, done, chunk = still, done + budget, chunk + 1
        return GenerationOutput(ids, logps, truncated, token_versions=versions)
