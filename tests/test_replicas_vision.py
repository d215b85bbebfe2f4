"""The vision-language replicas load with the classes their users load them with (transformers'
AutoModelForImageTextToText, AutoTokenizer, AutoImageProcessor), in their own dtype, and render
images through the family's chat template."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from grouprl.replicas import build_replica


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    return build_replica("qwen2-vl", tmp_path_factory.mktemp("qwen2-vl"))


def test_qwen2_vl_layout_and_classes(qwen2_vl):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    config = json.loads((qwen2_vl / "config.json").read_text())
    assert config["architectures"] == ["Qwen2VLForConditionalGeneration"]
    assert config["model_type"] == "qwen2_vl"
    pre = json.loads((qwen2_vl / "preprocessor_config.json").read_text())
    assert (pre["patch_size"], pre["merge_size"], pre["temporal_patch_size"]) == (14, 2, 2)
    assert pre["min_pixels"] == 3136 and pre["max_pixels"] == 12845056
    model = AutoModelForImageTextToText.from_pretrained(qwen2_vl)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert model.dtype == torch.bfloat16
    tok = AutoTokenizer.from_pretrained(qwen2_vl)
    assert type(tok).__name__ == "Qwen2Tokenizer"
    assert tok.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id
    assert tok.eos_token == "<|im_end|>"
    # ids in Qwen's order: <|endoftext|> first after the vocabulary, <|video_pad|> 13 later
    assert (
        tok.convert_tokens_to_ids("<|video_pad|>") - tok.convert_tokens_to_ids("<|endoftext|>")
        == 13
    )
    image_processor = AutoImageProcessor.from_pretrained(qwen2_vl)
    assert "Qwen2VLImageProcessor" in type(image_processor).__name__


def test_qwen2_vl_template_renders_image_items(qwen2_vl):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen2_vl)
    image = Image.new("RGB", (56, 56))
    msgs = [{"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "text", "text": "What colour?"}]}]  # fmt: skip
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>What colour?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                        {"type": "text", "text": "Q"}]}]  # fmt: skip
    assert "Picture 2: <|vision_start|>" in tok.apply_chat_template(
        two, tokenize=False, add_vision_id=True
    )


def test_qwen2_vl_generates_from_an_image(qwen2_vl):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(qwen2_vl)
    tok, proc = (
        AutoTokenizer.from_pretrained(qwen2_vl),
        AutoImageProcessor.from_pretrained(qwen2_vl),
    )
    image = Image.new("RGB", (56, 56), (200, 30, 30))
    vision = proc(images=[image], return_tensors="pt")
    assert vision["image_grid_thw"].tolist() == [[1, 4, 4]]  # 56 px / 14 = 4 patches a side
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q"}]}],
        add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    text = text.replace("<|image_pad|>", "<|image_pad|>" * 4)  # 16 patches / 2x2 merge
    ids = tok(text, return_tensors="pt")
    out = model.generate(**ids, **vision, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, ids["input_ids"].shape[1] + 3)


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    return build_replica("qwen2.5-vl", tmp_path_factory.mktemp("qwen2.5-vl"))


def test_qwen2_5_vl_layout_and_vision_tower(qwen2_5_vl):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    config = json.loads((qwen2_5_vl / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert config["model_type"] == "qwen2_5_vl"
    vision = config["vision_config"]
    # the Qwen2.5-VL tower's own keys (Qwen2-VL's has embed_dim / mlp_ratio instead)
    for key in ("fullatt_block_indexes", "window_size", "out_hidden_size", "tokens_per_second",
                "intermediate_size", "hidden_act"):  # fmt: skip
        assert key in vision, key
    assert "embed_dim" not in vision and "mlp_ratio" not in vision
    assert vision["hidden_act"] == "silu" and vision["window_size"] == 112
    assert vision["out_hidden_size"] == config["text_config"]["hidden_size"]
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [4, 6, 6]
    gen = json.loads((qwen2_5_vl / "generation_config.json").read_text())
    assert (gen["temperature"], gen["repetition_penalty"], gen["top_k"]) == (0.1, 1.05, 1)
    pre = json.loads((qwen2_5_vl / "preprocessor_config.json").read_text())
    assert pre["processor_class"] == "Qwen2_5_VLProcessor"
    assert (pre["min_pixels"], pre["max_pixels"], pre["patch_size"]) == (3136, 12845056, 14)
    model = AutoModelForImageTextToText.from_pretrained(qwen2_5_vl)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert model.dtype == torch.bfloat16
    blocks = model.model.visual.blocks
    assert "RMSNorm" in type(blocks[0].norm1).__name__  # Qwen2-VL: LayerNorm
    assert hasattr(blocks[0].mlp, "gate_proj")  # SwiGLU
    tok = AutoTokenizer.from_pretrained(qwen2_5_vl)
    assert tok.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id
    assert "Qwen2VLImageProcessor" in type(AutoImageProcessor.from_pretrained(qwen2_5_vl)).__name__


def test_qwen2_5_vl_template_and_generate(qwen2_5_vl):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen2_5_vl)
    question = [{"type": "image"}, {"type": "text", "text": "x?"}]
    msgs = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": question}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nSolve it.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>x?<|im_end|>\n<|im_start|>assistant\n"
    )
    proc = AutoImageProcessor.from_pretrained(qwen2_5_vl)
    vision = proc(images=[Image.new("RGB", (112, 56), (10, 200, 30))], return_tensors="pt")
    assert vision["image_grid_thw"].tolist() == [[1, 4, 8]]  # 56 / 14 rows, 112 / 14 columns
    text = text.replace("<|image_pad|>", "<|image_pad|>" * 8)  # 32 patches / 2x2 merge
    ids = tok(text, return_tensors="pt")
    model = AutoModelForImageTextToText.from_pretrained(qwen2_5_vl)
    out = model.generate(**ids, **vision, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, ids["input_ids"].shape[1] + 3)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_replica("llava", tmp_path_factory.mktemp("llava"))


def test_llava_layout_and_classes(llava):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    config = json.loads((llava / "config.json").read_text())
    assert config["architectures"] == ["LlavaForConditionalGeneration"]
    assert config["model_type"] == "llava" and config["dtype"] == "float16"
    assert config["vision_config"]["model_type"] == "clip_vision_model"
    assert config["text_config"]["model_type"] == "llama"
    assert config["vision_feature_select_strategy"] == "default"
    assert config["vision_feature_layer"] == -2 and config["projector_hidden_act"] == "gelu"
    assert config["image_seq_length"] == 16  # (56 / 14) ** 2 patches, CLS dropped
    assert config["text_config"]["vocab_size"] % 64 == 0  # padded as the real 32064
    pre = json.loads((llava / "preprocessor_config.json").read_text())
    assert pre["crop_size"] == {"height": 56, "width": 56} and pre["do_center_crop"]
    model = AutoModelForImageTextToText.from_pretrained(llava)
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert model.dtype == torch.float16  # llava-hf/llava-1.5-7b-hf ships float16, not bf16
    assert type(model.model.vision_tower).__name__ == "CLIPVisionModel"
    tok = AutoTokenizer.from_pretrained(llava)
    # transformers 5 loads llava's tokenizer as TokenizersBackend (its list of hub folders with
    # a wrong tokenizer_class); the folder declares LlamaTokenizer as the real one does
    assert json.loads((llava / "tokenizer_config.json").read_text())["tokenizer_class"] == (
        "LlamaTokenizer"
    )
    assert tok.convert_tokens_to_ids("<image>") == model.config.image_token_id
    assert tok.convert_tokens_to_ids("<pad>") == model.config.image_token_id + 1
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok("a").input_ids[0] == 1  # BOS added, EOS not
    assert tok("a").input_ids[-1] != 2
    assert type(AutoImageProcessor.from_pretrained(llava)).__name__ == "CLIPImageProcessorPil"


def test_llava_template_renders_as_llava_1_5(llava):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llava)
    msgs = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "What is it?"}, {"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        {"role": "user", "content": [{"type": "text", "text": "Colour?"}]},
    ]
    # images come before the text of their message; a space after every text item
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == (
        "Be brief. USER: <image>\nWhat is it? ASSISTANT: A cat. USER: Colour? ASSISTANT:"
    )


def test_llava_expands_image_and_generates(llava):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    tok, proc = AutoTokenizer.from_pretrained(llava), AutoImageProcessor.from_pretrained(llava)
    model = AutoModelForImageTextToText.from_pretrained(llava)
    pixels = proc(images=[Image.new("RGB", (84, 56), (9, 90, 200))], return_tensors="pt")
    assert pixels["pixel_values"].shape == (1, 3, 56, 56)  # shortest edge 56, centre crop
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q"}]}],
        add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    ids = tok(text.replace("<image>", "<image>" * 16), return_tensors="pt")
    assert int((ids["input_ids"] == model.config.image_token_id).sum()) == 16
    features = model.model.get_image_features(pixel_values=pixels["pixel_values"].half())
    features = getattr(features, "pooler_output", features)
    assert sum(f.shape[0] for f in features) == 16  # 16 patches, the CLS feature dropped
    out = model.generate(
        **ids, pixel_values=pixels["pixel_values"].half(), max_new_tokens=3, do_sample=False
    )
    assert out.shape == (1, ids["input_ids"].shape[1] + 3)


# the keys of Qwen2.5-VL-3B-Instruct's config.json as the hub repo publishes it (transformers
# 4.x layout: the decoder's keys at the top, rope_scaling with the mrope sections, the vision
# tower's keys with the legacy aliases in_chans / spatial_patch_size)
QWEN2_5_VL_PUBLISHED_TOP = {
    "architectures", "attention_dropout", "bos_token_id", "eos_token_id", "vision_start_token_id",
    "vision_end_token_id", "vision_token_id", "image_token_id", "video_token_id", "hidden_act",
    "hidden_size", "initializer_range", "intermediate_size", "max_position_embeddings",
    "max_window_layers", "model_type", "num_attention_heads", "num_hidden_layers",
    "num_key_value_heads", "rms_norm_eps", "rope_theta", "sliding_window", "tie_word_embeddings",
    "torch_dtype", "transformers_version", "use_cache", "use_sliding_window", "vision_config",
    "rope_scaling", "vocab_size",
}  # fmt: skip
QWEN2_5_VL_PUBLISHED_VISION = {
    "depth", "hidden_act", "hidden_size", "intermediate_size", "num_heads", "in_chans",
    "out_hidden_size", "patch_size", "spatial_merge_size", "spatial_patch_size", "window_size",
    "fullatt_block_indexes", "tokens_per_second", "temporal_patch_size",
}  # fmt: skip


def test_qwen2_5_vl_published_config_layout_builds_the_same_model(qwen2_5_vl, tmp_path):
    """The replica's config written in the hub repo's own layout (flat, rope_scaling, legacy
    vision keys) loads the replica's weights with no key missing and gives the same logits."""
    import shutil

    from transformers import AutoModelForImageTextToText

    ours = json.loads((qwen2_5_vl / "config.json").read_text())
    text, vision = ours["text_config"], ours["vision_config"]
    published = {k: text[k] for k in QWEN2_5_VL_PUBLISHED_TOP if k in text}
    published.update({k: ours[k] for k in QWEN2_5_VL_PUBLISHED_TOP if k in ours})
    published.update(
        architectures=ours["architectures"], model_type="qwen2_5_vl", torch_dtype="bfloat16",
        transformers_version="4.41.2", use_cache=True,
        vision_token_id=published["image_token_id"] - 1,
        rope_theta=text["rope_parameters"]["rope_theta"],
        rope_scaling={"type": "mrope", "mrope_section": text["rope_parameters"]["mrope_section"]},
    )  # fmt: skip
    published.pop("dtype", None)
    published["vision_config"] = {k: vision[k] for k in QWEN2_5_VL_PUBLISHED_VISION if k in vision}
    published["vision_config"].update(in_chans=3, spatial_patch_size=vision["patch_size"])
    assert set(published) == QWEN2_5_VL_PUBLISHED_TOP
    assert set(published["vision_config"]) == QWEN2_5_VL_PUBLISHED_VISION
    folder = tmp_path / "published"
    shutil.copytree(qwen2_5_vl, folder)
    (folder / "config.json").write_text(json.dumps(published, indent=2))
    a = AutoModelForImageTextToText.from_pretrained(qwen2_5_vl, dtype=torch.float32).eval()
    b, info = AutoModelForImageTextToText.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert b.config.text_config.rope_parameters["mrope_section"] == [4, 6, 6]
    assert b.config.vision_config.fullatt_block_indexes == [1]
    ids = torch.tensor([[1, 5, 9, 30, 2]])
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids).logits, b.eval()(input_ids=ids).logits)


def test_llava_processor_loads_and_expands_as_transformers_does(llava):
    """LLaVA's AutoProcessor needs no torchvision: the folder's processor_config.json gives it
    patch 14 and one CLS token, so each <image> becomes image_seq_length = 16 tokens; the
    processor adds <s> (the template does not write it)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    proc = AutoProcessor.from_pretrained(llava)
    assert type(proc).__name__ == "LlavaProcessor"
    msgs = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (56, 56))},
                                         {"type": "text", "text": "Q"}]}]  # fmt: skip
    inputs = proc.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    model = AutoModelForImageTextToText.from_pretrained(llava)
    ids = inputs["input_ids"][0]
    assert ids[0].item() == 1  # <s>
    assert int((ids == model.config.image_token_id).sum()) == model.config.image_seq_length == 16
    inputs["pixel_values"] = inputs["pixel_values"].half()
    out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert out.shape == (1, len(ids) + 2)
