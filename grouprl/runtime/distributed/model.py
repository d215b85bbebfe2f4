"""The policy as the training loop sees it under several processes (see grouprl/runtime/distributed/dist.py).

- the module DDP / FSDP2 / DeepSpeed wrap is the policy's `scoring_module()` (for text policies
  policies/text/scoring_module.py): its forward is the scoring call, where their hooks run.
- `DistributedPolicy`: the text policy whose `log_probs` and parameters are the wrapped module's
  (a policy with its own `with_scoring_module`, e.g. flows' policies/flow/wrapped.py, brings its
  own view instead).
- `ScoreView`: what prepare() scores with: each process scores an equal share of the rows and the
  results (the whole PolicyOutput: logp, entropy, extras such as a flow's step means) are
  all-gathered (old / reference scores of the whole batch, never duplicated).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from grouprl.types import PolicyOutput


def _policy_attr(name: str, settable: bool = False) -> property:
    """The wrapped policy's attribute `name`, read (and, if settable, written) through."""

    def get(self: Any) -> Any:
        return getattr(self.policy, name)

    def put(self: Any, value: Any) -> None:
        setattr(self.policy, name, value)

    return property(get, put if settable else None, doc=f"The wrapped policy's `{name}`.")


# CausalLMPolicy's surface (flow policies bring their own view: with_scoring_module),
# minus what a wrapper defines itself: its attributes, then its methods
_TEXT_POLICY = {
    "model": _policy_attr("model"), "tokenizer": _policy_attr("tokenizer"),
    "engine": _policy_attr("engine"), "lora": _policy_attr("lora"),
    "logprob_path": _policy_attr("logprob_path"), "stop_ids": _policy_attr("stop_ids"),
    "lora_targets": _policy_attr("lora_targets"), "head_note": _policy_attr("head_note"),
    "logprob_chunk_size": _policy_attr("logprob_chunk_size"),
    "compute_dtype": _policy_attr("compute_dtype"),
    "prompt_token_limit": _policy_attr("prompt_token_limit", settable=True),  # prompt_guard.py
    "device_of_model": _policy_attr("device_of_model"),
    "encode_prompts": _policy_attr("encode_prompts"), "sample": _policy_attr("sample"),
    "save_pretrained": _policy_attr("save_pretrained"), "state_dict": _policy_attr("state_dict"),
    "load_state_dict": _policy_attr("load_state_dict"), "to": _policy_attr("to"),
}  # fmt: skip


class DistributedPolicy:
    """The policy whose `log_probs` and parameters are the wrapped ScoringModule's; the rest of the
    text policy's surface (sample, reference, save_pretrained, engine ...: _TEXT_POLICY) is the
    wrapped policy's, whose `model` is the trained model itself (DDP, ZeRO-2) or a refreshed
    plain copy (sharded)."""

    def __init__(self, policy: Any, module: Any, backend: Any) -> None:
        self.policy, self.module, self.backend = policy, module, backend

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def train(self, mode: bool = True) -> DistributedPolicy:
        self.policy.train(mode)
        self.module.train(mode)
        return self

    def eval(self) -> DistributedPolicy:
        return self.train(False)

    def load_saved_weights(self, directory: Any) -> None:
        """Resume: the saved full weights into the policy's model, then into the shards."""
        self.policy.load_saved_weights(directory)
        if hasattr(self.backend, "copy"):
            self.backend.load_full(self.policy.model.state_dict())

    def log_probs(self, batch, *, temperature: float = 1.0, with_entropy: bool = True,
                  chunk_size: int | None = None, entropy_grad: bool = False) -> PolicyOutput:  # fmt: skip
        logp, entropy = self.module(
            batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
            temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad,
            chunk_size=chunk_size,
        )  # fmt: skip  # [N, T] each
        return PolicyOutput(logp=logp, entropy=entropy)

    reference = _policy_attr("reference")


class ScoreView:
    """prepare()'s view of the policy: log_probs and the reference's log_probs score this
    process's share of rows and all-gather the whole [N, T]."""

    def __init__(self, policy: Any, dist: Any) -> None:
        self.policy, self.dist = policy, dist

    def log_probs(self, batch, **kwargs: Any) -> PolicyOutput:
        """The policy's PolicyOutput (logp, entropy, extras such as a flow's step means) of the
        whole batch, each process scoring its share of the rows."""
        return self.dist.score_rows(lambda rows: self.policy.log_probs(rows, **kwargs), batch)

    def kl(self, out: PolicyOutput, ref_out: PolicyOutput) -> Tensor:
        """The policy's own KL (flow policies: the Gaussian mean-space KL), on gathered outputs."""
        return self.policy.kl(out, ref_out)

    @contextmanager
    def reference(self) -> Iterator[Any]:
        with self.policy.reference() as ref:
            yield _SplitScorer(ref, self.dist)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return self.policy.trainable_parameters()

    def train(self, mode: bool = True) -> Any:
        return self.policy.train(mode)

    def eval(self) -> Any:
        return self.policy.eval()

    def load_saved_weights(self, directory: Any) -> None:
        self.policy.load_saved_weights(directory)


for _name, _attr in _TEXT_POLICY.items():  # the same explicit surface on both wrappers
    setattr(DistributedPolicy, _name, _attr)
    setattr(ScoreView, _name, _attr)


class _SplitScorer:
    def __init__(self, scorer: Any, dist: Any) -> None:
        self.scorer, self.dist = scorer, dist

    def log_probs(self, batch, *args: Any, **kwargs: Any) -> Any:
        """The reference's scores of the whole batch (text: logp [N, T]; flows: a PolicyOutput),
        each process scoring its share of the rows."""
        return self.dist.score_rows(lambda b: self.scorer.log_probs(b, *args, **kwargs), batch)
