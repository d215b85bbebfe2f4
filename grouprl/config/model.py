"""The `model:` section, typed by `model.type`: a language model (causal_lm), a vision-language
model (vlm: image-text-to-text) or an image / video policy (flow, unet). Each type carries only
its own fields; a field of another type is an error naming the allowed ones (a text config
setting `negative_prompt` fails).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from grouprl.config.section import Section


class LoRAConfig(Section):
    """LoRA adapters (peft). Targets are resolved from the model's module tree when the policy
    is built, before any step; the resolved list is logged once and written to
    lora_targets.json next to the resolved config and in every checkpoint's model folder."""

    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: int = Field(32, ge=1, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(
        0.0, ge=0, lt=1,
        description="Dropout on the LoRA input (must be 0 when parameters are targeted: peft's "
        "parameter LoRA has no input dropout).",
    )  # fmt: skip
    target_modules: Literal["all-linear", "attention"] | list[str] = Field(
        "all-linear",
        description="all-linear: every linear layer (nn.Linear / Conv1D) of the language model "
        "except the output head, as peft resolves it (fused qkv_proj / gate_up_proj included; "
        "a VLM's vision tower and projector excluded). attention (flow / unet denoisers): every "
        "linear layer inside a diffusers attention module, whatever the family calls its "
        "blocks (what the flow presets set). Or module names, peft's rule: an entry "
        "matches a module whose dotted path is the entry or ends with '.' + entry; an entry "
        "that matches no linear layer is an error listing the linear layers' names. "
        "flow / unet: the family's attention projections unless set.",
    )
    target_parameters: Literal["experts", "none"] | list[str] = Field(
        "experts",
        description="nn.Parameters that get LoRA through peft's parameter targeting. experts: "
        "every 3-D weight of the language model outside torch.nn layers (MoE expert stacks "
        "such as mlp.experts.gate_up_proj / down_proj [E, out, in]; none in dense models); "
        "none: no parameter; or parameter names (suffix rule as target_modules), e.g. a "
        "router's mlp.gate.weight (routers are not adapted unless named here). Merged saves "
        "keep the original weight names. causal_lm / vlm only.",
    )


# fields both policy kinds have (one definition each)
NameOrPath = Annotated[
    str,
    Field(
        description="Hub id or local save_pretrained folder (flow / unet: a diffusers pipeline "
        "folder or hub id; or a user velocity module class 'package.module:Class' / "
        "'file.py:Class')."
    ),
]
Dtype = Annotated[
    Literal["float32", "bfloat16", "float16"],
    Field(
        description="Compute dtype (autocast) and the frozen weights' storage; trainable weights "
        "and optimizer state stay float32 (master weights); float16 adds dynamic loss scaling."
    ),
]
LoRA = Annotated[
    LoRAConfig | None, Field(description="Train LoRA adapters instead of all weights.")
]
ChatFallback = Annotated[
    Literal["announce", "error"],
    Field(
        description="When the chat template lacks what a chat needs (probed by rendering it): "
        "announce applies the stated fallback with one warning (system text folded into the "
        "first user message; tools listed in plain text; tool results sent as a user message; "
        "assistant tool calls written as text); error refuses, naming the template."
    ),
]
SupportCheck = Annotated[
    Literal["refuse", "warn", "off"],
    Field(
        description="What the support matrix (docs/support_matrix.md, written by `python -m "
        "grouprl.replicas sweep`) does with this model's architecture when the config is read: "
        "refuse (a failed scoring check is an error, other failed checks and an architecture "
        "not in the matrix are warnings), warn (everything a warning) or off."
    ),
]
GradientCheckpointing = Annotated[
    bool,
    Field(
        description="Recompute activations in backward (transformers' switch for causal_lm, "
        "diffusers' for the flow transformer / UNet; an error where the model has none)."
    ),
]


class TextModelConfig(Section):
    """A causal language model (transformers), workloads text and agent."""

    type: Literal["causal_lm"] = Field("causal_lm", description="A causal LM (text).")
    name_or_path: NameOrPath
    dtype: Dtype = "float32"
    lora: LoRA = None
    gradient_checkpointing: GradientCheckpointing = False
    logprob_chunk_size: int | None = Field(
        None, ge=1, description="Rows per LM-head chunk when scoring (None: policy default)."
    )
    logprob_path: Literal["fast", "plain"] = Field(
        "fast",
        description="Scoring: fast (each group's prompt once, fused LM head over the real "
        "completion tokens) or plain (one [prompt | completion] pass); same numbers.",
    )
    trust_remote_code: bool = Field(False, description="Allow model code from the hub.")
    chat_fallback: ChatFallback = "announce"
    support_check: SupportCheck = "refuse"


class VisionModelConfig(Section):
    """A vision-language model (transformers image-text-to-text: Qwen2-VL / Qwen2.5-VL, LLaVA,
    ...), workload vlm: images in the prompt, text out."""

    type: Literal["vlm"] = Field(
        "vlm", description="An image-text-to-text model (AutoModelForImageTextToText)."
    )
    name_or_path: NameOrPath
    dtype: Dtype = "float32"
    lora: LoRA = None
    vision_tower: Literal["frozen", "trainable"] = Field(
        "frozen",
        description="The vision encoder (and its projector): frozen (no gradient, no optimizer "
        "state) or trainable (full weights; LoRA adapters go to the language model only).",
    )
    gradient_checkpointing: GradientCheckpointing = False
    logprob_chunk_size: int | None = Field(
        None, ge=1, description="Rows per LM-head chunk when scoring (None: policy default)."
    )
    logprob_path: Literal["fast", "plain"] = Field(
        "fast",
        description="Scoring: fast (each group's prompt and images once, the completions on the "
        "expanded cache) or plain (one [prompt | completion] pass per row); same numbers.",
    )
    trust_remote_code: bool = Field(False, description="Allow model code from the hub.")
    chat_fallback: ChatFallback = "announce"
    support_check: SupportCheck = "refuse"


class ImageModelConfig(Section):
    """An image / video policy (grouprl/workloads/images/policy.py), workload images."""

    type: Literal["flow", "unet"] = Field(
        "flow",
        description="flow (a diffusers flow transformer pipeline: SD3 / FLUX / Wan / SANA / "
        "Qwen-Image, or a user velocity module), unet (SD 1.x / SDXL UNet with DDIM, DDPO); "
        "another pipeline class is refused when the config is read.",
    )
    name_or_path: NameOrPath
    dtype: Dtype = "float32"
    lora: LoRA = None
    gradient_checkpointing: GradientCheckpointing = False
    weights: str | None = Field(
        None,
        description="User velocity module: folder of its weights (Class.from_pretrained(folder), or "
        "its *.safetensors loaded into Class(**module_options)); None: fresh weights.",
    )
    module_options: dict[str, Any] = Field(
        default_factory=dict, description="User velocity module: constructor keyword arguments."
    )
    condition: Literal["prompt", "class_label", "prompt_image"] = Field(
        "prompt",
        description="prompt: text embeddings of the example's prompt (cached); class_label: the "
        "example's class_label column (class-conditional user modules); prompt_image: the prompt "
        "and the example's `image` column (a PIL image or bytes, e.g. a hub dataset's Image "
        "feature) as the reference image every step sees (FLUX.1 Kontext pipelines).",
    )
    null_label: int | None = Field(
        None, ge=0, description="class_label: the model's 'no class' id (needed for CFG)."
    )
    pixel_range: Literal["zero_one", "minus_one_one"] = Field(
        "minus_one_one", description="A model without VAE works in pixels of this range."
    )
    negative_prompt: str = Field(
        "", description="Unconditional prompt of classifier-free guidance."
    )
    max_sequence_length: int | None = Field(
        None, ge=1, description="T5 prompt length (None: the pipeline's default)."
    )
    experts: Literal["both", "high_noise", "low_noise"] = Field(
        "both",
        description="A two-expert pipeline (Wan 2.2 A14B: transformer_2 and boundary_ratio): which "
        "experts train. both; high_noise (transformer, the steps at or above the boundary; "
        "transformer_2 frozen); low_noise (transformer_2, the steps below it; transformer "
        "frozen). A frozen expert still draws its steps. Only for two-expert pipelines.",
    )


ModelConfig = Annotated[
    TextModelConfig | VisionModelConfig | ImageModelConfig, Field(discriminator="type")
]
DEFAULT_MODEL_TYPE = "causal_lm"  # a model mapping without `type`
