"""The image / video replicas (grouprl/replicas/diffusion.py): each folder has the hub layout, loads
with diffusers' DiffusionPipeline.from_pretrained as its own pipeline class, runs a 2-step pipeline
call at a tiny size, and carries its family's scheduler, VAE and tokenizer settings. The CLIP reward
replicas load through the rewards that use them.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grouprl.replicas import REPLICAS
from grouprl.replicas.bpe import byte_alphabet, clip_vocab

PIPELINES = {
    "sd3.5-medium": "StableDiffusion3Pipeline",
    "flux.1-dev": "FluxPipeline",
    "flux.1-schnell": "FluxPipeline",
    "wan2.1-t2v": "WanPipeline",
    "wan2.2-t2v-a14b": "WanPipeline",
    "wan2.2-ti2v-5b": "WanPipeline",
    "flux.1-kontext-dev": "FluxKontextPipeline",
    "sd1.5": "StableDiffusionPipeline",
    "sdxl": "StableDiffusionXLPipeline",
    "sana-1.6b": "SanaPipeline",
    "qwen-image": "QwenImagePipeline",
}
LAYOUT = {
    "sd3.5-medium": {"scheduler", "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer",
                     "tokenizer_2", "tokenizer_3", "transformer", "vae"},
    "flux.1-dev": {"scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2",
                   "transformer", "vae"},
    "wan2.1-t2v": {"scheduler", "text_encoder", "tokenizer", "transformer", "vae"},
    "sd1.5": {"feature_extractor", "safety_checker", "scheduler", "text_encoder", "tokenizer",
              "unet", "vae"},
    "sdxl": {"scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "unet",
             "vae"},
    "sana-1.6b": {"scheduler", "text_encoder", "tokenizer", "transformer", "vae"},
    "qwen-image": {"scheduler", "text_encoder", "tokenizer", "transformer", "vae"},
}  # fmt: skip
LAYOUT["flux.1-schnell"] = LAYOUT["flux.1-kontext-dev"] = LAYOUT["flux.1-dev"]
LAYOUT["wan2.2-ti2v-5b"] = LAYOUT["wan2.1-t2v"]
LAYOUT["wan2.2-t2v-a14b"] = {*LAYOUT["wan2.1-t2v"], "transformer_2"}  # the low-noise expert
# the files each tokenizer class's hub folder has
TOKENIZER_FILES = {
    "CLIPTokenizer": {"vocab.json", "merges.txt"},
    "T5TokenizerFast": {"spiece.model"},
    "GemmaTokenizerFast": {"tokenizer.json"},
    "Qwen2Tokenizer": {"vocab.json", "merges.txt"},
}
# the dtype a pipeline is loaded in, as its model card does (Qwen-Image's folder is bfloat16)
LOAD_DTYPE = {"qwen-image": torch.bfloat16}


def _size_mb(folder):
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_layout_and_size(replica, name):
    folder = replica(name)
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == PIPELINES[name]
    parts = {k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[0]}
    assert parts == LAYOUT[name]
    assert {p.name for p in folder.iterdir() if p.is_dir()} == LAYOUT[name]
    for part in parts - {"scheduler", "tokenizer", "tokenizer_2", "tokenizer_3",
                         "feature_extractor"}:  # fmt: skip
        assert (folder / part / "config.json").exists()
        assert any(p.suffix == ".safetensors" for p in (folder / part).iterdir())
    for tok in [p for p in parts if p.startswith("tokenizer")]:
        cls = index[tok][1]
        files = {p.name for p in (folder / tok).iterdir()}
        assert TOKENIZER_FILES[cls] <= files and "tokenizer_config.json" in files, (tok, files)
    assert _size_mb(folder) < 5


SCHEDULERS = {
    "sd3.5-medium": ("FlowMatchEulerDiscreteScheduler",
                     {"shift": 3.0, "use_dynamic_shifting": False, "num_train_timesteps": 1000}),
    "flux.1-dev": ("FlowMatchEulerDiscreteScheduler",
                   {"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
                    "base_image_seq_len": 256, "max_image_seq_len": 4096, "shift": 3.0}),
    "flux.1-schnell": ("FlowMatchEulerDiscreteScheduler",
                       {"use_dynamic_shifting": False, "shift": 1.0}),
    "wan2.1-t2v": ("UniPCMultistepScheduler",
                   {"prediction_type": "flow_prediction", "use_flow_sigmas": True,
                    "flow_shift": 3.0, "solver_order": 2, "solver_type": "bh2"}),
    "wan2.2-t2v-a14b": ("UniPCMultistepScheduler",
                        {"prediction_type": "flow_prediction", "use_flow_sigmas": True,
                         "flow_shift": 3.0}),
    "wan2.2-ti2v-5b": ("UniPCMultistepScheduler",
                       {"prediction_type": "flow_prediction", "use_flow_sigmas": True,
                        "flow_shift": 5.0}),
    "flux.1-kontext-dev": ("FlowMatchEulerDiscreteScheduler",
                           {"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15}),
    "sd1.5": ("PNDMScheduler",
              {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
               "skip_prk_steps": True, "set_alpha_to_one": False, "steps_offset": 1}),
    "sdxl": ("EulerDiscreteScheduler",
             {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
              "prediction_type": "epsilon", "timestep_spacing": "leading", "steps_offset": 1}),
    "sana-1.6b": ("DPMSolverMultistepScheduler",
                  {"algorithm_type": "dpmsolver++", "solver_type": "midpoint", "solver_order": 2,
                   "prediction_type": "flow_prediction", "use_flow_sigmas": True,
                   "flow_shift": 3.0}),
    "qwen-image": ("FlowMatchEulerDiscreteScheduler",
                   {"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 0.9,
                    "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02,
                    "time_shift_type": "exponential"}),
}  # fmt: skip
VAES = {
    "sd3.5-medium": {"scaling_factor": 1.5305, "shift_factor": 0.0609, "latent_channels": 16,
                     "use_quant_conv": False},
    "flux.1-dev": {"scaling_factor": 0.3611, "shift_factor": 0.1159, "latent_channels": 16},
    "sd1.5": {"scaling_factor": 0.18215, "latent_channels": 4, "use_quant_conv": True},
    "wan2.1-t2v": {"z_dim": 16, "temperal_downsample": [False, True, True]},
    "sdxl": {"scaling_factor": 0.13025, "latent_channels": 4, "force_upcast": True},
    "sana-1.6b": {"scaling_factor": 0.41407, "latent_channels": 32},
    "qwen-image": {"z_dim": 16, "temperal_downsample": [False, True, True]},
    "wan2.2-t2v-a14b": {"z_dim": 16, "scale_factor_spatial": 8, "scale_factor_temporal": 4},
    "wan2.2-ti2v-5b": {"z_dim": 48, "is_residual": True, "patch_size": 2,
                       "scale_factor_spatial": 16, "scale_factor_temporal": 4},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_scheduler_and_vae_settings(replica, name):
    folder = replica(name)
    cls, expected = SCHEDULERS[name]
    config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    assert config["_class_name"] == cls
    assert {k: config[k] for k in expected} == expected
    vae = json.loads((folder / "vae" / "config.json").read_text())
    want = VAES.get(name, VAES["flux.1-dev"])
    assert {k: vae[k] for k in want} == want
    if name == "sana-1.6b":  # DC-AE f32c32: 6 levels, 32x
        assert len(vae["encoder_block_out_channels"]) == 6
    elif "block_out_channels" in vae:  # the real KL VAEs downsample 8x: 4 levels
        assert len(vae["block_out_channels"]) == 4


def test_flux_guidance_embeds_dev_only(replica):
    dev = json.loads((replica("flux.1-dev") / "transformer" / "config.json").read_text())
    schnell = json.loads((replica("flux.1-schnell") / "transformer" / "config.json").read_text())
    assert dev["guidance_embeds"] is True and schnell["guidance_embeds"] is False
    assert dev["in_channels"] == 64 and sum(dev["axes_dims_rope"]) == dev["attention_head_dim"]


CALLS = {
    "sd3.5-medium": dict(height=32, width=32, guidance_scale=4.5, max_sequence_length=16),
    "flux.1-dev": dict(height=32, width=32, guidance_scale=3.5, max_sequence_length=16),
    "flux.1-schnell": dict(height=32, width=32, guidance_scale=0.0, max_sequence_length=16),
    "wan2.1-t2v": dict(height=32, width=32, num_frames=5, guidance_scale=5.0,
                       max_sequence_length=16),
    "wan2.2-t2v-a14b": dict(height=32, width=32, num_frames=5, guidance_scale=4.0,
                            guidance_scale_2=3.0, max_sequence_length=16),
    "wan2.2-ti2v-5b": dict(height=32, width=32, num_frames=5, guidance_scale=5.0,
                           max_sequence_length=16),
    "flux.1-kontext-dev": dict(height=32, width=32, max_area=32 * 32, guidance_scale=2.5,
                               max_sequence_length=16, _auto_resize=False),
    "sd1.5": dict(height=64, width=64, guidance_scale=7.5),
    "sdxl": dict(height=64, width=64, guidance_scale=5.0),
    "sana-1.6b": dict(height=64, width=64, guidance_scale=4.5, max_sequence_length=16,
                      use_resolution_binning=False),
    "qwen-image": dict(height=32, width=32, true_cfg_scale=4.0, negative_prompt=" ",
                       max_sequence_length=64),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_loads_as_its_pipeline_and_runs_two_steps(replica, name):
    import diffusers

    folder = replica(name)
    dtype = LOAD_DTYPE.get(name, torch.float32)
    pipe = diffusers.DiffusionPipeline.from_pretrained(folder, dtype=dtype)
    assert type(pipe).__name__ == PIPELINES[name]
    same = getattr(diffusers, PIPELINES[name]).from_pretrained(folder, dtype=dtype)
    assert type(same.scheduler).__name__ == SCHEDULERS[name][0]
    kw = dict(CALLS[name], num_inference_steps=2, output_type="pt",
              generator=torch.Generator().manual_seed(0))  # fmt: skip
    if name == "sd1.5":  # the safety checker runs on the output (random weights: may black out)
        assert pipe.safety_checker is not None and pipe.feature_extractor is not None
    if name == "flux.1-kontext-dev":  # the reference image to edit
        kw["image"] = torch.rand(1, 3, 32, 32)
    out = pipe(prompt="a red bicycle leaning against a brick wall", **kw)
    images = out.frames if name.startswith("wan") else out.images
    images = torch.as_tensor(images).float()
    assert torch.isfinite(images).all()
    side = CALLS[name]["height"]
    if name.startswith("wan"):  # [B, F, 3, H, W]
        assert images.shape == (1, 5, 3, side, side)
    else:
        assert images.shape == (1, 3, side, side)


def test_clip_tokenizers_are_real_bpe(replica):
    from transformers import CLIPTokenizer, T5TokenizerFast

    folder = replica("sd3.5-medium")
    tok = CLIPTokenizer.from_pretrained(folder / "tokenizer")
    vocab = json.loads((folder / "tokenizer" / "vocab.json").read_text())
    merges = (folder / "tokenizer" / "merges.txt").read_text().splitlines()
    assert merges[0].startswith("#version") and len(merges) > 100
    assert vocab["!"] == 0 and vocab["!</w>"] == 256  # CLIP's byte table order
    assert vocab["<|endoftext|>"] == len(vocab) - 1 == tok.eos_token_id
    assert vocab["<|startoftext|>"] == len(vocab) - 2 == tok.bos_token_id
    ids = tok("A Red  Bicycle!").input_ids
    assert tok.convert_ids_to_tokens(ids) == [
        "<|startoftext|>", "a</w>", "red</w>", "bicycle</w>", "!</w>", "<|endoftext|>"]  # fmt: skip
    assert tok.model_max_length == 77 and tok.pad_token == "<|endoftext|>"
    assert CLIPTokenizer.from_pretrained(folder / "tokenizer_2").pad_token == "!"  # CLIP-G
    t5 = T5TokenizerFast.from_pretrained(folder / "tokenizer_3")
    assert (t5.pad_token_id, t5.eos_token_id, t5.unk_token_id) == (0, 1, 2)
    assert t5.model_max_length == 512 and "<extra_id_0>" in t5.get_vocab()
    assert t5("a red bicycle").input_ids[-1] == 1  # </s> appended, no bos
    assert t5.unk_token_id not in t5("A Red Bicycle, 12 cups!").input_ids


def test_clip_vocab_layout_by_hand():
    """bytes, bytes + </w>, merges in order, then the two specials."""
    vocab = clip_vocab([("a", "b"), ("ab", "c</w>")])
    assert len(vocab) == 512 + 2 + 2
    assert vocab["ab"] == 512 and vocab["abc</w>"] == 513
    assert vocab["<|startoftext|>"] == 514 and vocab["<|endoftext|>"] == 515
    alphabet = byte_alphabet()
    assert alphabet[0] == "!" and alphabet[93] == "~" and alphabet[-1] == "\u0143"
    assert alphabet.index("\u0120") == 188 + 32  # byte 32 (space) -> U+0120


@pytest.mark.parametrize("name", ["pickscore", "clip-vit-large-patch14"])
def test_clip_reward_replicas_load_in_their_rewards(replica, name):
    from grouprl.envs.rewards.image_models import clip_score, pickscore

    folder = str(replica(name))
    config = json.loads((replica(name) / "config.json").read_text())
    assert config["architectures"] == ["CLIPModel"]
    assert (
        config["vision_config"]["patch_size"] == 14 and config["vision_config"]["image_size"] == 224
    )
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for preprocess in ("tensor", "processor"):
        fn = (pickscore if name == "pickscore" else clip_score)(
            model=folder, processor=folder, preprocess=preprocess
        )
        values = fn(images, prompts=["a red circle", "a blue square"])
        assert len(values) == 2 and all(isinstance(v, float) for v in values)
    # PickScore's trained logit scale (exp = 100) vs CLIP's initial one (exp = 1 / 0.07)
    assert config["logit_scale_init_value"] == (4.6052 if name == "pickscore" else 2.6592)
    act = config["text_config"]["hidden_act"]
    assert act == ("gelu" if name == "pickscore" else "quick_gelu")


def test_replicas_command_lists_and_builds(tmp_path):
    run = [sys.executable, "-m", "grouprl.replicas"]
    root = str(Path(__file__).resolve().parents[1])  # this checkout's grouprl, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    listed = subprocess.run([*run, "--list"], capture_output=True, text=True, check=True, env=env)
    assert set(REPLICAS) <= {line.split()[0] for line in listed.stdout.splitlines()}
    out = subprocess.run([*run, "flux.1-schnell", str(tmp_path / "f")], capture_output=True,
                         text=True, check=True, env=env)  # fmt: skip
    assert (tmp_path / "f" / "model_index.json").exists() and str(tmp_path / "f") in out.stdout
    bad = subprocess.run(
        [*run, "sd9", str(tmp_path / "g")], capture_output=True, text=True, env=env
    )
    assert bad.returncode == 2 and "unknown replica 'sd9'" in bad.stderr


def test_sdxl_conditioning_settings(replica):
    """Two CLIP encoders (CLIP-L without projection, CLIP-G with), a text_time UNet whose added
    embedding width is 6 time ids x addition_time_embed_dim + CLIP-G's projection_dim, and
    force_zeros_for_empty_prompt, as stable-diffusion-xl-base-1.0."""
    folder = replica("sdxl")
    index = json.loads((folder / "model_index.json").read_text())
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"]
    assert index["text_encoder_2"] == ["transformers", "CLIPTextModelWithProjection"]
    assert index["force_zeros_for_empty_prompt"] is True
    unet = json.loads((folder / "unet" / "config.json").read_text())
    proj = json.loads((folder / "text_encoder_2" / "config.json").read_text())["projection_dim"]
    assert unet["addition_embed_type"] == "text_time"
    assert (
        unet["projection_class_embeddings_input_dim"] == 6 * unet["addition_time_embed_dim"] + proj
    )
    widths = [json.loads((folder / f / "config.json").read_text())["hidden_size"]
              for f in ("text_encoder", "text_encoder_2")]  # fmt: skip
    assert unet["cross_attention_dim"] == sum(widths)


def test_sana_and_qwen_image_text_encoders(replica):
    """SANA: Gemma2Model with Gemma 2's soft-capping and special-token ids, BOS added, right
    padding. Qwen-Image: Qwen2.5-VL in bfloat16 whose tokenizer splits the pipeline's prompt
    template prefix into the 34 tokens the pipeline drops."""
    from diffusers import QwenImagePipeline
    from transformers import AutoTokenizer

    from grouprl.replicas.diffusion import QWEN_IMAGE_SYSTEM

    sana = replica("sana-1.6b")
    gemma = json.loads((sana / "text_encoder" / "config.json").read_text())
    assert gemma["architectures"] == ["Gemma2Model"]
    assert (gemma["final_logit_softcapping"], gemma["attn_logit_softcapping"]) == (30.0, 50.0)
    tok = AutoTokenizer.from_pretrained(sana / "tokenizer")
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert tok("a red cube").input_ids[0] == 2 and tok.padding_side == "right"
    qwen = replica("qwen-image")
    config = json.loads((qwen / "text_encoder" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert config["dtype"] == "bfloat16"
    transformer = json.loads((qwen / "transformer" / "config.json").read_text())
    assert transformer["joint_attention_dim"] == config["text_config"]["hidden_size"]
    assert transformer["in_channels"] == 4 * transformer["out_channels"] == 64
    tok = AutoTokenizer.from_pretrained(qwen / "tokenizer")
    pipe = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=tok,
                             transformer=None)  # fmt: skip
    ids = tok(pipe.prompt_template_encode.format("a red cube")).input_ids
    drop = pipe.prompt_template_encode_start_idx
    assert drop == 34 and QWEN_IMAGE_SYSTEM in pipe.prompt_template_encode
    assert tok.decode(ids[drop:]).startswith("a red cube<|im_end|>")
    assert tok.decode(ids[:drop]).endswith("<|im_start|>user\n")
