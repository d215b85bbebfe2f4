"""vlm_judge: P(yes) / (P(yes) + P(no)) of a VLM (the Qwen2-VL replica) about each image."""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image

import grouprl.workloads  # noqa: F401  (registers vlm_judge)
from grouprl.envs.rewards import REWARDS, build_reward
from grouprl.envs.rewards.image import to_uint8_hwc
from grouprl.policies.vision.policy import VisionLMPolicy
from grouprl.replicas.vision import build_qwen2_vl


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_qwen2_vl(tmp_path_factory.mktemp("judge"))


def _by_hand(folder, image: torch.Tensor, question: str) -> float:
    """The model's own forward on the chat-templated question: sigmoid(logit yes - logit no)."""
    policy = VisionLMPolicy.from_pretrained(str(folder))
    tok = policy.tokenizer
    pil = Image.fromarray(to_uint8_hwc(image))
    messages = [{"role": "user", "content": [{"type": "image", "image": pil},
                                             {"type": "text", "text": question}]}]  # fmt: skip
    e = policy.processor.encode(messages)
    ids = torch.tensor([e.token_ids])
    types = (ids == policy.model.config.image_token_id).int()
    with torch.no_grad():
        logits = policy.model(input_ids=ids, mm_token_type_ids=types, **e.vision).logits[0, -1]
    yes, no = tok("yes", add_special_tokens=False).input_ids[0], tok("no").input_ids[0]
    return 1 / (1 + math.exp(-(float(logits[yes]) - float(logits[no]))))


def test_registered_and_equal_to_the_models_own_probability(folder):
    assert "vlm_judge" in REWARDS
    g = torch.Generator().manual_seed(0)
    images = torch.rand(3, 3, 28, 42, generator=g)  # [N, 3, H, W] in [0, 1]
    prompts = ["red circle", "blue square", "green triangle"]
    judge = build_reward("vlm_judge", model=str(folder), batch_size=2)
    scores = judge(images=images, prompts=prompts)
    assert len(scores) == 3 and all(0 < s < 1 for s in scores)
    for i in range(3):
        want = _by_hand(
            folder, images[i], f"Does this image show a {prompts[i]}? Answer yes or no."
        )
        assert scores[i] == pytest.approx(want, abs=1e-5)
    alone = build_reward("vlm_judge", model=str(folder), batch_size=1)(
        images=images, prompts=prompts
    )
    assert scores == pytest.approx(alone, abs=1e-5)


def test_question_with_columns_and_a_video_is_judged_on_its_middle_frame(folder):
    g = torch.Generator().manual_seed(1)
    video = torch.rand(1, 3, 5, 28, 28, generator=g)  # [N, 3, F, H, W]
    judge = build_reward("vlm_judge", model=str(folder), question="Is it {colour}?")
    got = judge(images=video, prompts=["x"], colour=["red"])
    assert got[0] == pytest.approx(_by_hand(folder, video[0, :, 2], "Is it red?"), abs=1e-5)


def test_errors_name_the_problem(folder):
    with pytest.raises(ValueError, match="same token"):
        build_reward("vlm_judge", model=str(folder), yes="yes", no="yes")
    with pytest.raises(ValueError, match="batch_size"):
        build_reward("vlm_judge", model=str(folder), batch_size=0)
    judge = build_reward("vlm_judge", model=str(folder))
    with pytest.raises(ValueError, match="prompt"):
        judge(images=torch.rand(1, 3, 28, 28))
