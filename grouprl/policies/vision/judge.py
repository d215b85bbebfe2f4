"""`vlm_judge`: a vision-language model asked a yes / no question about each image, as a reward.

The reward of an image is the judge's probability of "yes" against "no" as the first answer
token after the question, P(yes) / (P(yes) + P(no)) = sigmoid(logit_yes - logit_no), in [0, 1]:
e.g. "Does this image show a {prompt}? Answer yes or no." for a text-to-image prompt (the
prompt-alignment check of VQAScore-style rewards, arXiv:2404.01291, with a chat VLM). The judge is
the VLM policy class itself (VisionLMPolicy: any transformers image-text-to-text model, its
processor and chat template), loaded once, in eval mode, without gradient, on its own device and
dtype. Deviations: the score uses the FIRST token of " yes" / " no" as the tokenizer splits the
words `yes` / `no` (an error when the two share it); images are scored at the size the judge's
image processor resizes them to.

Images come in every form of the image rewards (grouprl/envs/rewards/image.py); a video is judged
on its middle frame. The question template may use {prompt} and any example column.
"""

from __future__ import annotations

from string import Formatter
from typing import Any

import torch
from PIL import Image

from grouprl.envs.rewards import register_reward
from grouprl.envs.rewards.image import as_frames, to_uint8_hwc
from grouprl.envs.rewards.loading import RewardFn
from grouprl.policies.vision.policy import VisionLMPolicy

DEFAULT_QUESTION = "Does this image show a {prompt}? Answer yes or no."


def _first_token(tokenizer: Any, word: str) -> int:
    ids = tokenizer(word, add_special_tokens=False).input_ids
    if not ids:
        raise ValueError(f"vlm_judge: the answer word {word!r} has no tokens")
    return ids[0]


def vlm_judge(
    model: str,
    question: str = DEFAULT_QUESTION,
    yes: str = "yes",
    no: str = "no",
    device: str = "cpu",
    dtype: str = "float32",
    batch_size: int = 16,
) -> RewardFn:
    """P(yes) of a vision-language model asked a yes / no question about each image.

    model: a hub id or local folder of an image-text-to-text model (the judge, VisionLMPolicy).
    question: the template asked about each image ({prompt} and columns by name).
    yes, no: the answer words whose first tokens are compared.
    device, dtype: where and in which precision the judge runs.
    batch_size: images per forward pass.
    """
    names = {n for _, n, _, _ in Formatter().parse(question) if n}
    if batch_size < 1:
        raise ValueError(f"vlm_judge: batch_size must be >= 1, got {batch_size}")
    judge = VisionLMPolicy.from_pretrained(model, dtype=dtype).to(device).eval()
    tokenizer = judge.processor.tokenizer
    yes_id, no_id = _first_token(tokenizer, yes), _first_token(tokenizer, no)
    if yes_id == no_id:
        raise ValueError(f"vlm_judge: {yes!r} and {no!r} start with the same token")

    def score(images: Any, prompts: list | None = None, **columns: Any) -> list[float | None]:
        frames = as_frames(images)  # per sample Float[F, 3, H, W] in [0, 1]
        n = len(frames)
        out: list[float | None] = []
        for start in range(0, n, batch_size):
            messages = []
            for i in range(start, min(n, start + batch_size)):
                values = {k: v[i] for k, v in columns.items() if k in names and len(v) == n}
                if "prompt" in names:
                    if prompts is None:
                        raise ValueError("vlm_judge: the question uses {prompt}; no prompts given")
                    values["prompt"] = prompts[i]
                frame = frames[i][len(frames[i]) // 2]  # [3, H, W]: a video's middle frame
                image = Image.fromarray(to_uint8_hwc(frame))
                text = question.format(**values)
                messages.append([{"role": "user", "content": [{"type": "image", "image": image},
                                                              {"type": "text", "text": text}]}])  # fmt: skip
            logits = judge.next_token_logits(messages)  # [b, V]
            pair = logits[:, [yes_id, no_id]].float()  # [b, 2]
            out.extend(torch.sigmoid(pair[:, 0] - pair[:, 1]).tolist())
        return out

    return score


register_reward("vlm_judge", vlm_judge)
