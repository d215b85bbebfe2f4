"""The distillation teacher (algorithm.distill, source `model`): a second causal LM, frozen, in the
run's compute dtype, that scores the completions the student sampled.

It never samples (no engine) and stays in eval mode with requires_grad off; its log-probs of the
sampled tokens go through the same chunked scoring path as the policy's (logprobs.py), and the
exact full-vocabulary KL pairs its LM head with the student's chunk by chunk
(CausalLMPolicy.distill_kl). Its tokenizer must map every token to the same id as the student's
(otherwise "the same token" means different things to the two models), and for the full KL both
LM heads must have the same width.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from grouprl.policies.precision import as_dtype, compute
from grouprl.policies.text.loading import DType, load_causal_lm
from grouprl.policies.text.logprobs import completion_logprobs
from grouprl.types import TokenBatch

KEY = "algorithm.distill.teacher"


class TeacherModel:
    """A frozen causal LM with `log_probs(batch, temperature) -> [N, T]` (no grad; masked slots
    0) and `.model` (the transformers model, for the full-vocabulary KL)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        compute_dtype: torch.dtype | str = torch.float32,
        chunk_size: int | None = None,
        path: str = "fast",
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.compute_dtype = as_dtype(compute_dtype)
        self.chunk_size, self.path = chunk_size, path

    @classmethod
    def from_folder(
        cls,
        folder: str,
        *,
        student_tokenizer: Any,
        student_model: Any = None,
        dtype: DType = "float32",
        trust_remote_code: bool = False,
        chunk_size: int | None = None,
        path: str = "fast",
    ) -> TeacherModel:
        """Load the teacher folder (a local save_pretrained folder) and check it against the
        student; every error names algorithm.distill.teacher."""
        check_teacher_folder(folder)
        model, tokenizer = load_causal_lm(folder, dtype, trust_remote_code)
        check_same_vocabulary(tokenizer, student_tokenizer, folder)
        if student_model is not None:
            check_same_head_width(model, student_model, folder)
        return cls(model, tokenizer, compute_dtype=dtype, chunk_size=chunk_size, path=path)

    def to(self, device: torch.device | str) -> TeacherModel:
        self.model.to(device)
        return self

    @torch.no_grad()
    def log_probs(self, batch: TokenBatch, temperature: float = 1.0) -> Tensor:  # [N, T]
        with compute(self.compute_dtype, batch.prompt_ids.device):
            return completion_logprobs(
                self.model, batch, temperature=temperature, chunk_size=self.chunk_size,
                with_entropy=False, path=self.path,
            )[0]  # fmt: skip


class EngineTeacher:
    """The teacher served by an inference engine (algorithm.distill source `engine`): its
    log-probs of the sampled tokens from the engine's scoring call (`engine.score(prompt ids,
    completion ids)`, engines/vllm.py), padded to [N, T]. Engines score at temperature 1 only;
    there is no full distribution (estimator `full` is refused at validation)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @torch.no_grad()
    def log_probs(self, batch: TokenBatch, temperature: float = 1.0) -> Tensor:  # [N, T]
        if temperature != 1.0:
            raise ValueError(
                f"algorithm.distill.source='engine' scores at temperature 1 (vLLM's prompt "
                f"log-probs skip the temperature), but rollout.temperature={temperature}; use "
                "source 'model' or temperature 1"
            )
        prompts = [ids[m].tolist() for ids, m in zip(batch.prompt_ids, batch.prompt_mask)]
        completions = [
            ids[m].tolist() for ids, m in zip(batch.completion_ids, batch.completion_mask)
        ]
        scored = self.engine.score(prompts, completions)
        out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)  # [N, T]
        for i, row in enumerate(scored):
            if len(row) != len(completions[i]):
                raise RuntimeError(
                    f"the teacher engine scored {len(row)} tokens of row {i}, which has "
                    f"{len(completions[i])}"
                )
            out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)  # [t_i]
        return out.to(batch.completion_ids.device)  # [N, T]


def check_teacher_folder(folder: str) -> None:
    """A local folder holding a model (config.json), else one error naming the key."""
    p = Path(folder).expanduser()
    if not p.is_dir():
        raise ValueError(
            f"{KEY}={folder!r}: no such folder ({str(p.resolve())!r}); the teacher is a local "
            "model folder (save_pretrained layout), e.g. a run's checkpoint model folder"
        )
    if not (p / "config.json").exists():
        raise ValueError(
            f"{KEY}={folder!r}: the folder has no config.json, so it holds no saved model"
        )


def check_same_vocabulary(teacher_tokenizer: Any, student_tokenizer: Any, folder: str) -> None:
    """The two tokenizers map every token to the same id, else one error naming the key."""
    t, s = teacher_tokenizer.get_vocab(), student_tokenizer.get_vocab()
    if t != s:
        only_t = sorted(set(t) - set(s))[:3]
        moved = sorted(k for k in set(t) & set(s) if t[k] != s[k])[:3]
        raise ValueError(
            f"{KEY}={folder!r}: the teacher's tokenizer vocabulary differs from the student's "
            f"(model.name_or_path): {len(t)} vs {len(s)} tokens; only in the teacher: {only_t}, "
            f"different ids: {moved}. Distillation compares the two models token by token, so "
            "they need the same tokenizer"
        )


def check_same_head_width(teacher_model: Any, student_model: Any, folder: str) -> None:
    """Both LM heads give logits over the same number of ids (the full-vocabulary KL)."""
    t = teacher_model.get_output_embeddings().weight.shape[0]
    s = student_model.get_output_embeddings().weight.shape[0]
    if t != s:
        raise ValueError(
            f"{KEY}={folder!r}: the teacher's LM head has {t} outputs and the student's {s}; "
            "algorithm.distill.estimator 'full' compares whole distributions and needs the same "
            "width (k1 / k3 only need the same tokenizer)"
        )
