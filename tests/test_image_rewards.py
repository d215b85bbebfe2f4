"""Image rewards: input forms, JPEG size, colour target, CLIP score / PickScore / aesthetic on a tiny
random CLIP saved to disk and loaded back by path (the code path a hub id takes), and several image
rewards combined with per-reward normalisation (GDPO)."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from grouprl.envs.rewards import REWARDS, build_reward, score_completions
from grouprl.envs.rewards.aesthetic_head import AestheticHead, load_aesthetic_head
from grouprl.envs.rewards.clip import load_clip, pixels_processor, pixels_tensor
from grouprl.envs.rewards.image import (
    as_frames,
    color_target,
    jpeg_compressibility,
    jpeg_incompressibility,
)
from grouprl.envs.rewards.image_models import aesthetic, clip_score, pickscore
from grouprl.objectives.advantages import compute_advantages


def flat(rgb, h=32, w=32) -> torch.Tensor:
    """A one-colour image; exact colours (0.2 ...) stay exact, PIL round trips quantise them."""
    return torch.tensor(rgb, dtype=torch.float32)[:, None, None].expand(3, h, w).clone()


def noise(seed, h=32, w=32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (3, h, w), generator=g) / 255).float()  # quantised: k / 255


def to_pil(x: torch.Tensor) -> Image.Image:
    arr = (x * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    return Image.fromarray(arr)


# ---------------------------------------------------------------- input forms


def test_as_frames_accepts_every_form_and_agrees():
    x = noise(0)
    video = torch.stack([x, flat([0.2, 0.4, 0.6])], dim=1)  # [3, F=2, H, W]
    arr = (x * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    forms = [x, to_pil(x), arr, arr.astype(np.float32) / 255, (x * 255).round().to(torch.uint8)]
    for out in as_frames(forms):
        assert out.shape == (1, 3, 32, 32)
        torch.testing.assert_close(out, x[None], atol=1e-6, rtol=0)
    (v,) = as_frames(video[None])  # [N=1, 3, F, H, W]
    assert v.shape == (2, 3, 32, 32)
    torch.testing.assert_close(v[1], flat([0.2, 0.4, 0.6]))
    (frames,) = as_frames([[to_pil(x), to_pil(x)]])  # a list of PIL frames = one video sample
    assert frames.shape == (2, 3, 32, 32)


def test_as_frames_rejects_wrong_range_and_shapes():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        as_frames(torch.full((1, 3, 4, 4), -0.9))  # a [-1, 1] image passed by mistake
    small = as_frames(torch.full((1, 3, 4, 4), 1.002))[0]  # overshoot below 1/255 is clamped
    assert small.max().item() == 1.0
    with pytest.raises(ValueError, match=r"\[N, 3, H, W\]"):
        as_frames(torch.zeros(2, 4, 8, 8))
    with pytest.raises(TypeError, match="PIL image"):
        as_frames(["not an image"])


# ---------------------------------------------------------------- JPEG (DDPO)


def test_jpeg_flat_image_compresses_better_than_noise():
    inc, comp = jpeg_incompressibility(), jpeg_compressibility()
    images = torch.stack([flat([0.5, 0.5, 0.5], 64, 64), noise(1, 64, 64)])
    sizes = inc(images)
    assert sizes[0] < 1.5 < 5.0 < sizes[1]  # a flat 64x64 JPEG is ~0.8 kB, noise ~9 kB
    assert comp(images) == [-s for s in sizes]
    # the value is the byte count / 1000 of PIL's JPEG at quality 95 of the uint8 image
    buf = io.BytesIO()
    to_pil(images[1]).save(buf, format="JPEG", quality=95)
    assert sizes[1] == len(buf.getvalue()) / 1000
    assert jpeg_incompressibility(quality=10)(images)[1] < sizes[1]


def test_jpeg_video_is_the_mean_over_frames_and_nan_gives_none():
    inc = jpeg_incompressibility()
    a, b = flat([0.1, 0.9, 0.3]), noise(2)
    video = torch.stack([a, b], dim=1)[None]  # [1, 3, 2, 32, 32]
    still = inc(torch.stack([a, b]))
    assert inc(video) == [pytest.approx((still[0] + still[1]) / 2, abs=1e-12)]
    bad = b.clone()
    bad[0, 0, 0] = math.nan
    assert inc(torch.stack([a, bad])) == [still[0], None]
    with pytest.raises(ValueError, match="quality"):
        jpeg_incompressibility(quality=0)


# ---------------------------------------------------------------- colour target


def test_color_target_exact_values():
    half = torch.zeros(3, 4, 4)
    half[:, :, 2:] = 1.0  # half black, half white: mean (0.5, 0.5, 0.5)
    images = torch.stack([flat([0.2, 0.4, 0.6], 4, 4), half, flat([1.0, 0.0, 0.0], 4, 4)])
    rgb = color_target(target=[0.0, 0.0, 0.0])(images)
    # 1 - |m| / sqrt(3): sqrt(0.04 + 0.16 + 0.36) = sqrt(0.56); |(0.5,0.5,0.5)| = sqrt(0.75)
    expected = [1 - math.sqrt(0.56 / 3), 1 - 0.5, 1 - 1 / math.sqrt(3)]
    assert rgb == pytest.approx(expected, abs=1e-6)
    assert color_target(target=[0.2, 0.4, 0.6])(images)[0] == pytest.approx(1.0, abs=1e-6)
    assert color_target(target="red")(images)[2] == pytest.approx(1.0, abs=1e-6)
    # brightness target: BT.601 luma of pure red is 0.299, of mid grey 0.5
    bright = color_target(target=0.0)(images)
    assert bright[1:] == pytest.approx([0.5, 1 - 0.299], abs=1e-6)


def test_color_target_per_sample_column_none_and_errors():
    images = [to_pil(flat([1.0, 0.0, 0.0])), to_pil(flat([0.0, 0.0, 1.0])), flat([0, 0, 0])]
    fn = color_target(target_column="color")
    out = fn(images, prompts=["a", "b", "c"], color=["red", [0.0, 0.0, 1.0], None])
    assert out[:2] == pytest.approx([1.0, 1.0], abs=1e-6) and out[2] is None
    with pytest.raises(KeyError, match="color"):
        fn(images)
    with pytest.raises(ValueError, match="exactly one"):
        color_target()
    with pytest.raises(ValueError, match="0..255"):
        color_target(target=[255, 0, 0])
    with pytest.raises(ValueError, match="unknown colour"):
        color_target(target="reddish")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['colour'\]"):
        build_reward("color_target", colour="red")


def test_registry_and_score_completions_with_an_image_tensor():
    for name in ("jpeg_compressibility", "jpeg_incompressibility", "color_target"):
        assert name in REWARDS
    for name in ("clip_score", "pickscore", "aesthetic"):
        assert name in REWARDS
    images = torch.stack([flat([0.2, 0.4, 0.6]), noise(3)])
    fns = {
        "jpeg": build_reward("jpeg_compressibility"),
        "green": build_reward("color_target", target_column="target"),
    }
    examples = [{"prompt": "p", "target": [0.0, 1.0, 0.0]}, {"prompt": "q", "target": "lime"}]
    rewards, errors = score_completions(fns, images, examples, items_name="images")
    assert errors == {"jpeg": 0, "green": 0}
    assert rewards["jpeg"].tolist() == pytest.approx(jpeg_compressibility()(images), rel=1e-6)
    direct = color_target(target=[0.0, 1.0, 0.0])(images)
    assert rewards["green"].tolist() == pytest.approx(direct, abs=1e-6)


def test_a_failing_sample_costs_only_that_sample():
    """A bad per-sample target raises on the batch; score_completions retries one by one and
    gives that sample NaN (counted in errors), the others their values."""
    images = torch.stack([flat([0.0, 1.0, 0.0]), flat([0.0, 0.0, 1.0]), flat([1.0, 0.0, 0.0])])
    fns = {"c": build_reward("color_target", target_column="color")}
    examples = [
        {"prompt": "a", "color": "lime"},
        {"prompt": "b", "color": "no such colour"},
        {"prompt": "c", "color": [1.0, 0.0, 0.0]},
    ]
    rewards, errors = score_completions(fns, images, examples, items_name="images")
    assert errors == {"c": 1}
    assert rewards["c"][[0, 2]].tolist() == pytest.approx([1.0, 1.0], abs=1e-6)
    assert math.isnan(rewards["c"][1].item())


# ---------------------------------------------------------------- several image rewards (GDPO)


def test_normalize_then_sum_combines_image_rewards_per_reward():
    """Each reward is z-scored within its group before the weighted sum, so rescaling one reward
    (kB vs bytes) leaves the advantages unchanged (up to the 1e-4 eps); a plain weighted sum does
    not."""
    g = torch.Generator().manual_seed(4)
    images = []
    for i in range(6):  # blends of a flat colour and noise: sizes and colours vary together
        a = (i % 3) / 2
        images.append(a * flat([1.0, 0.0, 0.0]) + (1 - a) * noise(10 + i))
    images[4] = flat([1.0, 0.0, 0.0]) * 0.5 + torch.rand(3, 32, 32, generator=g) * 0.5
    images = torch.stack(images)  # [6, 3, 32, 32]
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    fns = {
        "jpeg": build_reward("jpeg_compressibility"),
        "red": build_reward("color_target", target="red"),
    }
    rewards, _ = score_completions(fns, images, [{"prompt": "x"}] * 6, items_name="images")
    weights = {"jpeg": 1.0, "red": 2.0}
    adv = compute_advantages(
        "grpo", rewards, group_ids, weights=weights, reward_aggregation="normalize_then_sum"
    )

    def z(r):  # per group: (r - mean) / (unbiased std + 1e-4)
        r = r.double().view(2, 3)
        return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)

    total = z(rewards["jpeg"]) + 2.0 * z(rewards["red"])
    expected = (total - total.mean()) / (total.std() + 1e-4)
    torch.testing.assert_close(adv.double(), expected, atol=1e-5, rtol=0)

    rescaled = dict(rewards, jpeg=rewards["jpeg"] * 1000)
    adv2 = compute_advantages(
        "grpo", rescaled, group_ids, weights=weights, reward_aggregation="normalize_then_sum"
    )
    torch.testing.assert_close(adv2, adv, atol=1e-4, rtol=0)
    plain = [compute_advantages("grpo", r, group_ids, weights=weights) for r in (rewards, rescaled)]
    assert (plain[0] - plain[1]).abs().max() > 0.1


# ---------------------------------------------------------------- tiny CLIP on disk


def _tiny_clip_tokenizer():
    from transformers import CLIPTokenizer

    from grouprl.policies.text.tiny import _byte_symbols

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):  # every byte alone, and as the last symbol of a word
        for sym in _byte_symbols():
            vocab.setdefault(sym + suffix, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=16)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """A random CLIP (32x32 images, 16-d embeddings) + processor saved with save_pretrained."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tok = _tiny_clip_tokenizer()
    small = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4)
    text = dict(
        small,
        vocab_size=len(tok),
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    config = CLIPConfig(
        text_config=text, vision_config=dict(small, image_size=32, patch_size=8), projection_dim=16
    )
    torch.manual_seed(0)
    model = CLIPModel(config)
    model.logit_scale.data.fill_(math.log(20.0))  # PickScore multiplies the cosine by exp(this)
    ip = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    path = tmp_path_factory.mktemp("tiny_clip")
    model.save_pretrained(path)
    CLIPProcessor(image_processor=ip, tokenizer=tok).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(clip_dir):
    """The same CLIP loaded independently, for hand computations."""
    from transformers import CLIPModel, CLIPProcessor

    return CLIPModel.from_pretrained(clip_dir).eval(), CLIPProcessor.from_pretrained(clip_dir)


def _manual_cos(reference, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """cos(image, text) with the CLIP normalisation written out (32x32 input: no resize/crop)."""
    model, proc = reference
    ip = proc.image_processor
    mean = torch.tensor(ip.image_mean)[:, None, None]
    std = torch.tensor(ip.image_std)[:, None, None]
    with torch.no_grad():
        img = model.get_image_features(pixel_values=(images - mean) / std).pooler_output
        cos = []
        for e, p in zip(img, prompts):
            t = proc.tokenizer([p], return_tensors="pt")
            txt = model.get_text_features(**t).pooler_output[0]
            cos.append(F.cosine_similarity(e, txt, dim=0))
    return torch.stack(cos)


def test_clip_score_and_pickscore_match_a_hand_computation(clip_dir, reference):
    images = torch.stack([noise(20), noise(21), flat([0.8, 0.2, 0.2])])
    prompts = ["a red dog", "a cat", "a red dog"]
    cos = _manual_cos(reference, images, prompts)
    out = clip_score(model=str(clip_dir))(images, prompts=prompts)
    assert out == pytest.approx((100 * cos).tolist(), abs=1e-4)
    raw = build_reward("clip_score", model=str(clip_dir), scale=1.0)(images, prompts=prompts)
    assert raw == pytest.approx(cos.tolist(), abs=1e-6)
    pick = pickscore(model=str(clip_dir), processor=None)(images, prompts=prompts)
    assert pick == pytest.approx((20.0 * cos).tolist(), abs=1e-4)  # exp(logit_scale) = 20


def test_clip_batch_equals_one_by_one_and_pil_equals_tensor(clip_dir):
    fn = clip_score(model=str(clip_dir))
    images = torch.stack([noise(30), noise(31), flat([0.2, 0.6, 1.0]), noise(32)])
    prompts = ["red", "a blue square", "green", "a long prompt that is truncated by the tokenizer"]
    batch = fn(images, prompts=prompts)
    single = [fn(images[i : i + 1], prompts=prompts[i : i + 1])[0] for i in range(4)]
    assert batch == pytest.approx(single, abs=1e-4)
    assert fn([to_pil(x) for x in images], prompts=prompts) == pytest.approx(batch, abs=1e-4)
    small = clip_score(model=str(clip_dir), batch_size=1)(images, prompts=prompts)
    assert small == pytest.approx(batch, abs=1e-4)


def test_clip_none_prompt_nan_image_video_and_errors(clip_dir):
    fn = clip_score(model=str(clip_dir))
    a, b = noise(40), noise(41)
    bad = a.clone()
    bad[1, 2, 3] = math.nan
    out = fn(torch.stack([a, b, bad]), prompts=["x", None, "x"])
    assert out[0] is not None and out[1:] == [None, None]
    assert fn(torch.stack([bad]), prompts=["x"]) == [None]
    video = torch.stack([a, b], dim=1)[None]  # [1, 3, F=2, 32, 32]
    stills = fn(torch.stack([a, b]), prompts=["y", "y"])
    assert fn(video, prompts=["y"]) == [pytest.approx(sum(stills) / 2, abs=1e-4)]
    with pytest.raises(ValueError, match="needs `prompts`"):
        fn(torch.stack([a]))
    with pytest.raises(ValueError, match="rows"):
        fn(torch.stack([a, b]), prompts=["only one"])
    with pytest.raises(ValueError, match="preprocess"):
        clip_score(model=str(clip_dir), preprocess="pil")
    with pytest.raises(OSError, match="cannot load"):
        clip_score(model=str(clip_dir / "missing"))


def test_tensor_preprocessing_matches_the_processor(clip_dir):
    ip = load_clip(str(clip_dir)).image_processor
    x = torch.stack([noise(50)])  # 32x32: no resize, so only quantisation could differ
    torch.testing.assert_close(pixels_tensor(x, ip), pixels_processor(x, ip), atol=1e-5, rtol=0)
    smooth = F.interpolate(noise(51, 8, 12)[None], size=(45, 70), mode="bilinear")  # [1,3,45,70]
    t, p = pixels_tensor(smooth, ip), pixels_processor(smooth, ip)
    assert t.shape == p.shape == (1, 3, 32, 32)  # shortest edge 32 -> 32x49, centre crop 32x32
    # PIL resizes uint8, torch floats, both antialiased bicubic: they differ by ~1/255 in [0, 1]
    # (measured 0.0046; bicubic without antialias 0.023, bilinear 0.029)
    assert (t - p).abs().max().item() * min(ip.image_std) < 0.01
    tall = pixels_tensor(smooth.transpose(2, 3), ip)  # 70x45 -> 49x32 -> crop
    assert tall.shape == (1, 3, 32, 32)
    fn_t = clip_score(model=str(clip_dir), scale=1.0)
    fn_p = clip_score(model=str(clip_dir), scale=1.0, preprocess="processor")
    assert fn_t(smooth, prompts=["z"]) == pytest.approx(fn_p(smooth, prompts=["z"]), abs=0.02)


def test_clip_models_are_loaded_once_per_process(clip_dir):
    a = load_clip(str(clip_dir))
    assert load_clip(str(clip_dir) + "/") is a  # same directory, however written
    assert load_clip(str(clip_dir), device="cpu", dtype="float32") is a
    assert load_clip(str(clip_dir), dtype="bfloat16") is not a
    with pytest.raises(ValueError, match="dtype"):
        load_clip(str(clip_dir), dtype="fp8")


# ---------------------------------------------------------------- aesthetic head


def _hand_head_state(d: int, layout: str) -> dict[str, torch.Tensor]:
    """Every hidden layer copies its first d inputs; the last maps h -> 0.5 + sum_k (k+1) h_k."""
    head = AestheticHead(d, layout)
    state = {}
    for key, value in head.state_dict().items():
        if key.endswith("bias"):
            state[key] = torch.zeros_like(value)
        else:
            w = torch.zeros_like(value)
            for j in range(min(w.shape[0], d)):
                w[j, j] = 1.0
            state[key] = w
    last = max((k for k in state if k.endswith("weight")), key=lambda k: int(k.split(".")[1]))
    state[last] = torch.arange(1.0, 17.0)[None]  # [1, 16]
    state[last.replace("weight", "bias")] = torch.tensor([0.5])
    return state


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_aesthetic_head_on_known_embeddings(tmp_path, suffix):
    from safetensors.torch import save_file

    for layout in ("linear", "relu"):
        path = tmp_path / f"{layout}{suffix}"
        state = _hand_head_state(16, layout)
        save_file(state, str(path)) if suffix == ".safetensors" else torch.save(state, path)
        head = load_aesthetic_head(path)
        assert (head.layout, head.input_size) == (layout, 16)
        e = torch.zeros(3, 16)
        e[0, 3], e[1, 15], e[2, 3] = 1.0, 0.5, -1.0
        # 0.5 + 4 * 1; 0.5 + 16 * 0.5; the negative input: affine (linear) vs clipped by ReLU
        third = -3.5 if layout == "linear" else 0.5
        torch.testing.assert_close(head(e), torch.tensor([4.5, 8.5, third]))
        assert load_aesthetic_head(path) is head  # cached per file


def test_aesthetic_head_errors(tmp_path):
    bad = tmp_path / "bad.pth"
    torch.save({"fc.weight": torch.zeros(1, 16)}, bad)
    with pytest.raises(ValueError, match="match no known layout"):
        load_aesthetic_head(bad)
    with pytest.raises(FileNotFoundError):
        load_aesthetic_head(tmp_path / "none.pth")


def test_aesthetic_reward_on_tiny_clip(clip_dir, reference, tmp_path):
    path = tmp_path / "head.pth"
    torch.save(_hand_head_state(16, "linear"), path)
    fn = build_reward("aesthetic", head=str(path), model=str(clip_dir))
    images = torch.stack([noise(60), flat([0.2, 0.4, 0.8]), noise(61)])
    model, proc = reference
    ip = proc.image_processor
    px = (images - torch.tensor(ip.image_mean)[:, None, None]) / torch.tensor(ip.image_std)[
        :, None, None
    ]
    with torch.no_grad():
        e = F.normalize(model.get_image_features(pixel_values=px).pooler_output, dim=-1)
    expected = 0.5 + (e * torch.arange(1.0, 17.0)).sum(-1)  # the hand head on unit embeddings
    out = fn(images)
    assert out == pytest.approx(expected.tolist(), abs=1e-5)
    single = [fn(images[i : i + 1])[0] for i in range(3)]
    assert single == pytest.approx(out, abs=1e-5)
    assert fn([to_pil(x) for x in images]) == pytest.approx(out, abs=1e-5)
    wide = tmp_path / "wide.pth"
    torch.save(_hand_head_state(768, "linear"), wide)
    with pytest.raises(ValueError, match="768"):
        aesthetic(head=str(wide), model=str(clip_dir))
    with pytest.raises(ValueError, match="needs the option `head`"):
        aesthetic(model=str(clip_dir))
