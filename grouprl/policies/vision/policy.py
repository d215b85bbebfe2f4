"""The vision-language policy: a transformers image-text-to-text model and its processor.

GRPO on a VLM is GRPO on its text (arXiv:2402.03300): G completions per prompt, per-token
log-probs of the completion tokens, now conditioned on the prompt's images. What this class adds
to the text policy (policies/text/causal_lm.py), whose conventions it keeps (float32 master
weights under a compute dtype, the reference as the adapter disabled or a frozen copy, a merged
save under LoRA):

- prompts are chat messages with image items, encoded by processing.py (chat template, image
  processor, image tokens); each row of the sampled TokenBatch carries its prompt's vision inputs
  (`TokenBatch.vision`), the G rows of a group sharing one dict;
- sampling (engines/fast.py, or vLLM with multimodal inputs) and scoring (logprobs.py) encode a
  group's prompt and images once;
- the action space excludes the image / video placeholder tokens: a completion holding one
  would be read as an image slot by the next forward (transformers then fails on the count of
  image features), so the engines never sample them and scoring gives them probability 0;
- LoRA (arXiv:2106.09685) goes to the LANGUAGE MODEL only: its targets are resolved inside
  `get_decoder()` (policies/lora_targets.py), so a CLIP tower's q_proj / v_proj and the
  projector are never adapted (an entry of lora.target_modules naming only them is an error
  listing the language model's linear layers); the vision tower
  and its projector are frozen (no gradient, no optimizer state) or trainable in full
  (`vision_tower`). With a trainable tower the reference is a frozen copy of the initial model
  (disabling the adapter would keep the trained tower).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from grouprl.policies.checkpoints import load_folder_weights, load_trained_state, trained_state
from grouprl.policies.lora_targets import LoRATargets, resolve_targets, write_targets
from grouprl.policies.precision import as_dtype, compute, compute_dtype_of, master_weights
from grouprl.policies.text.engines.base import SamplingParams, unwrap_peft
from grouprl.policies.text.loading import DTYPES, DType, check_source
from grouprl.policies.text.lora import (
    LoRASettings,
    add_lora,
    lora_settings,
    merged_state_dict,
)
from grouprl.policies.text.scoring_probe import check_vision_path
from grouprl.policies.vision.engines.base import VisionEngine
from grouprl.policies.vision.engines.fast import VisionDecoder, VisionFastEngine
from grouprl.policies.vision.logprobs import vision_completion_logprobs
from grouprl.policies.vision.processing import VisionProcessor
from grouprl.rollouts.seeds import group_seeds
from grouprl.types import PolicyOutput, Rollout, TokenBatch

VisionTower = Literal["frozen", "trainable"]
# engines that generate with the policy's own model object, by rollout.engine name
LOCAL_ENGINES: dict[str, Any] = {"fast": VisionFastEngine}


def load_vlm(name_or_path: str, dtype: DType, trust_remote_code: bool) -> tuple[Any, Any]:
    """(model, VisionProcessor) from a hub id or a save_pretrained folder; one clear error."""
    from transformers import AutoModelForImageTextToText

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_source(str(name_or_path))
    try:
        processor = VisionProcessor.from_pretrained(name_or_path, trust_remote_code)
        model = AutoModelForImageTextToText.from_pretrained(
            name_or_path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code
        )
    except (OSError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"could not load an image-text-to-text model and its processor from "
            f"{str(name_or_path)!r}: {first}"
        ) from None
    return model, processor


def vision_parameter_names(model: Any) -> set[str]:
    """Names (in `model.named_parameters()`) of the vision tower and its projector: every
    parameter of the inner model outside its language model."""
    hf = unwrap_peft(model)
    prefix = {n for n, m in hf.named_modules() if m is hf.model.language_model}.pop() + "."
    inner = {n for n, m in hf.named_modules() if m is hf.model}.pop() + "."
    vision = {
        n for n, _ in hf.named_parameters() if n.startswith(inner) and not n.startswith(prefix)
    }
    if model is hf:
        return vision
    # peft-wrapped: the same parameters under the wrapper's names
    ids = {id(p) for n, p in hf.named_parameters() if n in vision}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def language_model(model: Any) -> Any:
    """The model's language model (transformers' `get_decoder()`): where LoRA adapters go."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        raise ValueError(
            f"{type(model).__name__} names no language model (get_decoder()); LoRA cannot tell "
            "it from the vision tower: train without model.lora"
        )
    return decoder


def add_language_lora(model: Any, settings: LoRASettings) -> tuple[Any, LoRATargets]:
    """(the model wrapped by peft with a fresh adapter, the targets): the targets resolved in
    the language model only (get_decoder(); never the vision tower or projector)."""
    targets = resolve_targets(model, settings, scope=language_model(model))
    return add_lora(model, settings, targets), targets


class _Scorer:
    """What `reference()` yields: `.log_probs(batch, temperature)` without gradient."""

    def __init__(self, policy: VisionLMPolicy, model: Any) -> None:
        self._policy, self._model = policy, model

    @torch.no_grad()
    def log_probs(self, batch: TokenBatch, temperature: float = 1.0) -> Tensor:  # [N, T]
        p = self._policy
        with compute(p.compute_dtype, batch.prompt_ids.device):
            return vision_completion_logprobs(
                self._model, batch, temperature=temperature, chunk_size=p.logprob_chunk_size,
                with_entropy=False, path=p.logprob_path, banned=p.processor.placeholder_ids,
            )[0]  # fmt: skip


class VisionLMPolicy:
    """Samples groups of completions for prompts with images and scores their log-probs."""

    def __init__(
        self,
        model: Any,
        processor: VisionProcessor,
        *,
        lora: LoRASettings | dict | None = None,
        vision_tower: VisionTower = "frozen",
        gradient_checkpointing: bool = False,
        logprob_chunk_size: int | None = None,
        logprob_path: str = "fast",
        need_reference: bool = False,
        engine: VisionEngine | str | None = None,
        compute_dtype: torch.dtype | str | None = None,
    ) -> None:
        if vision_tower not in ("frozen", "trainable"):
            raise ValueError(f"vision_tower must be 'frozen' or 'trainable', got {vision_tower!r}")
        self.processor, self.vision_tower = processor, vision_tower
        self.lora = lora_settings(lora)
        self.compute_dtype = (
            compute_dtype_of(model) if compute_dtype is None else as_dtype(compute_dtype)
        )
        self.logprob_chunk_size, self.logprob_path = logprob_chunk_size, logprob_path
        # a frozen copy of the initial model, made before any training: the reference when the
        # adapter cannot stand for it (full fine-tuning, or a trainable tower under LoRA)
        self._ref_model: Any = None
        copy_reference = self.lora is None or vision_tower == "trainable"
        if need_reference and copy_reference:
            self._ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.lora_targets: LoRATargets | None = None  # resolved from the module tree, saved
        if self.lora is not None:
            model, self.lora_targets = add_language_lora(model, self.lora)
        tower = vision_parameter_names(model)
        for name, p in model.named_parameters():
            if name in tower:
                p.requires_grad_(vision_tower == "trainable")
        master_weights(model)
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.model = model
        # scoring against the model's own forward on a short batch: a gap over the dtype's
        # bound is refused by name (policies/text/scoring_probe.py)
        self.head_note = check_vision_path(
            model, logprob_path, self.compute_dtype,
            lambda: compute(self.compute_dtype, next(model.parameters()).device),
            processor.placeholder_ids,
        ).note  # fmt: skip
        if engine is None or isinstance(engine, str):
            name = engine or "fast"
            if name not in LOCAL_ENGINES:
                raise ValueError(
                    f"unknown local engine {name!r} for a vision-language model; choose from "
                    f"{list(LOCAL_ENGINES)} (or pass an engine object, e.g. vLLM's)"
                )
            engine = LOCAL_ENGINES[name](
                model, processor.tokenizer, banned=processor.placeholder_ids
            )
        self.engine: VisionEngine = engine

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        dtype: DType = "float32",
        trust_remote_code: bool = False,
        **kwargs: Any,
    ) -> VisionLMPolicy:
        """Load model + processor from a hub id or a local folder; kwargs go to __init__."""
        model, processor = load_vlm(name_or_path, dtype, trust_remote_code)
        return cls(model, processor, compute_dtype=dtype, **kwargs)

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    # ---- sampling ------------------------------------------------------------------------------

    def sample(
        self,
        prompts: list[Any],
        group_size: int,
        params: SamplingParams,
        *,
        engine: VisionEngine | None = None,
        group_ids: list[int] | Tensor | None = None,
        greedy: bool = False,
        seed: int | None = None,
    ) -> Rollout:
        """G = group_size completions per prompt (consecutive rows); rewards are left empty.
        seed: sample j of group g draws from its own generator seeded by (seed, g, j)."""
        if group_size < 1 or not prompts:
            raise ValueError(
                f"need >= 1 prompt and group_size >= 1, got {len(prompts)}, {group_size}"
            )
        group_ids = torch.as_tensor(
            range(len(prompts)) if group_ids is None else group_ids, dtype=torch.long
        )  # [B]
        if group_ids.shape != (len(prompts),):
            raise ValueError(f"group_ids must have one id per prompt ({len(prompts)})")
        encoded = [self.processor.encode(p) for p in prompts]
        rows = [e for e in encoded for _ in range(group_size)]  # G references to one object
        seeded = {}
        if seed is not None:
            seeded["seeds"] = group_seeds(seed, group_ids.tolist(), group_size)
        engine = engine or self.engine
        local = isinstance(engine, tuple(LOCAL_ENGINES.values()))
        ctx = (
            compute(self.compute_dtype, self.device_of_model())
            if local
            else contextlib.nullcontext()
        )
        with ctx:
            out = engine.generate(rows, params, greedy=greedy, **seeded)
        pad = self.tokenizer.pad_token_id
        p_ids = _pad([torch.tensor(r.token_ids) for r in rows], pad, "left")  # [N, P]
        p_mask = _pad([torch.ones(len(r.token_ids), dtype=torch.bool) for r in rows], 0, "left")
        c_ids = _pad([torch.tensor(c) for c in out.completion_ids], pad, "right")  # [N, T]
        c_mask = _pad(
            [torch.ones(len(c), dtype=torch.bool) for c in out.completion_ids], 0, "right"
        )  # [N, T]
        engine_logp = _pad([torch.tensor(lp) for lp in out.logprobs], 0.0, "right")  # [N, T]
        batch = TokenBatch(
            p_ids, p_mask, c_ids, c_mask, torch.tensor(out.truncated),
            vision=[r.vision for r in rows],
        )  # fmt: skip
        return Rollout(
            group_ids=group_ids.repeat_interleave(group_size),  # [N]
            rewards={},
            actions=batch,
            old_logp=engine_logp.clone(),  # [N, T]
            mask=c_mask.clone(),  # [N, T]
            engine_logp=engine_logp,
            info={
                "prompt": [p for p in prompts for _ in range(group_size)],
                "completion": self.tokenizer.batch_decode(
                    out.completion_ids, skip_special_tokens=True
                ),
                "completion_ids": out.completion_ids,
            },
        )

    @torch.no_grad()
    def next_token_logits(self, prompts: list[Any]) -> Tensor:
        """Logits [B, V] of the first token the model would write after each prompt (chat
        messages with images get the generation prompt): one batched forward, no gradient. What
        a judge reads its answer off (judge.py)."""
        encoded = [self.processor.encode(p) for p in prompts]
        was_training = self.model.training
        self.model.eval()
        try:
            with compute(self.compute_dtype, self.device_of_model()):
                return VisionDecoder(self.model, self.tokenizer.pad_token_id).prefill(encoded)
        finally:
            self.model.train(was_training)

    # ---- scoring -------------------------------------------------------------------------------

    def log_probs(
        self,
        batch: TokenBatch,
        *,
        temperature: float = 1.0,
        with_entropy: bool = True,
        chunk_size: int | None = None,
        entropy_grad: bool = False,
    ) -> PolicyOutput:
        """Differentiable logp [N, T] of the completion tokens given prompt and images, entropy
        [N, T] (no grad unless entropy_grad); masked slots are 0."""
        with compute(self.compute_dtype, batch.prompt_ids.device):
            logp, entropy = vision_completion_logprobs(
                self.model, batch, temperature=temperature,
                chunk_size=chunk_size or self.logprob_chunk_size, with_entropy=with_entropy,
                entropy_grad=entropy_grad, path=self.logprob_path,
                banned=self.processor.placeholder_ids,
            )  # fmt: skip  # [N, T] each
        return PolicyOutput(logp=logp, entropy=entropy)

    @contextlib.contextmanager
    def reference(self) -> Iterator[_Scorer]:
        """Scores under the frozen reference: the frozen copy when there is one, else (LoRA on a
        frozen tower) the adapter disabled."""
        if self._ref_model is not None:
            yield _Scorer(self, self._ref_model)
        elif self.lora is not None and self.vision_tower == "frozen":
            with self.model.disable_adapter():
                yield _Scorer(self, self.model)
        else:
            raise RuntimeError(
                "this VLM policy was built without need_reference=True, and its reference "
                "(the initial weights) is gone: build it with need_reference=True"
            )

    def device_of_model(self) -> torch.device:
        return next(iter(self.model.parameters())).device

    # ---- parameters and checkpoints ------------------------------------------------------------

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def train(self, mode: bool = True) -> VisionLMPolicy:
        self.model.train(mode)
        return self

    def eval(self) -> VisionLMPolicy:
        return self.train(False)

    def to(self, device: torch.device | str) -> VisionLMPolicy:
        self.model.to(device)
        if self._ref_model is not None:
            self._ref_model.to(device)
        return self

    def state_dict(self) -> dict[str, Tensor]:
        """Full weights, or under LoRA the trainable ones (adapters, and a trainable tower)."""
        return trained_state(self.model, self.lora)

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Inverse of state_dict(); checks the keys before touching any weight."""
        load_trained_state(self.model, self.lora, state)

    def load_saved_weights(self, directory: str | Path) -> None:
        """Load full weights written by save_pretrained (resume without LoRA); a tied lm_head may
        be absent, any other missing or unexpected key is an error."""
        load_folder_weights(self.model, directory)

    def save_pretrained(self, directory: str | Path) -> Path:
        """A folder transformers loads (AutoModelForImageTextToText + the processor files).
        Under LoRA the adapter is merged into the saved weights (the live model is untouched)
        and also saved to dir/adapter (peft; with a trainable tower only the merged folder holds
        the trained tower)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.lora is None:
            self.model.save_pretrained(directory, safe_serialization=True)
        else:
            self.model.save_pretrained(directory / "adapter", safe_serialization=True)
            base = self.model.get_base_model()
            base.save_pretrained(directory, state_dict=merged_state_dict(base))
            write_targets(self.lora_targets, directory)
        self.processor.save_pretrained(directory)
        return directory


def _pad(rows: list[Tensor], value: float, side: Literal["left", "right"]) -> Tensor:
    return pad_sequence(rows, batch_first=True, padding_value=value, padding_side=side)
