"""Every diffusers pipeline grouprl claims, by its real conditioning (issue #28): the SDXL, SANA
and Qwen-Image replicas (grouprl/replicas/diffusion.py) are conditioned exactly as their own
pipelines condition them, and a pipeline class grouprl does not train is refused by name while
the config is validated.

Each conditioning test runs the real pipeline for one step with a forward hook on its denoiser,
then calls grouprl's prediction (policies/flow/models.predict) on the same latents and timestep
with grouprl's own conditioning (policies/flow/text_encoders.PromptEncoder, which picks the
encoder from the pipeline's class): the outputs must match. Old code: SDXL crashed inside
diffusers (no text_embeds / time_ids, one text encoder), SANA and Qwen-Image had no family, and an
unsupported pipeline crashed inside grouprl naming no family.
"""

import json

import pytest
import torch

from grouprl.config.loading import ConfigError, validate
from grouprl.policies.flow.models import FAMILIES, pack_flux, predict, unpack_flux
from grouprl.policies.flow.text_encoders import PromptEncoder
from grouprl.policies.flow.types import FlowCondition


def _capture(module):
    """Every forward call of `module`: (args, kwargs, output tensor)."""
    calls = []

    def hook(mod, args, kwargs, out):
        calls.append((args, kwargs, out[0] if isinstance(out, tuple) else out.sample))

    return calls, module.register_forward_hook(hook, with_kwargs=True)


def _gen():
    return torch.Generator().manual_seed(0)


# ---- SDXL: two CLIP encoders, pooled embedding, micro-conditioning time ids ---------------------


def test_sdxl_unet_is_conditioned_as_the_pipeline_does(replica):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(replica("sdxl"))
    calls, hook = _capture(pipe.unet)
    pipe(prompt="a red cube", height=32, width=32, num_inference_steps=1, guidance_scale=1.0,
         output_type="latent", generator=_gen())  # fmt: skip
    hook.remove()
    (x, t), kwargs, expected = calls[0][0][:2], calls[0][1], calls[0][2]
    enc = PromptEncoder(pipe, image_size=(32, 32))  # the pipeline's class picks the encoder
    cond = enc(["a red cube"])
    # the pipeline's own conditioning: CLIP-L + CLIP-G penultimate states, CLIP-G's pooled
    # projection and (original, crop, target) time ids
    torch.testing.assert_close(cond.embeds["prompt_embeds"], kwargs["encoder_hidden_states"])
    added = kwargs["added_cond_kwargs"]
    torch.testing.assert_close(cond.embeds["text_embeds"], added["text_embeds"])
    torch.testing.assert_close(cond.embeds["time_ids"], added["time_ids"])
    assert cond.embeds["prompt_embeds"].shape[-1] == 32 + 48  # both encoders' widths
    assert cond.embeds["text_embeds"].shape[-1] == pipe.text_encoder_2.config.projection_dim == 40
    pred = predict(FAMILIES["unet"], pipe.unet, x, sigma=torch.zeros(1), timestep=t.reshape(1),
                   cond=cond.embeds, negative=None, guidance_scale=torch.ones(1))  # fmt: skip
    torch.testing.assert_close(pred, expected)


def test_sdxl_negative_follows_force_zeros_for_empty_prompt(replica):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(replica("sdxl"))
    assert pipe.config.force_zeros_for_empty_prompt is True
    empty = PromptEncoder(pipe, image_size=(32, 32))(["a red cube"]).negative
    assert not empty["prompt_embeds"].any() and not empty["text_embeds"].any()
    assert empty["time_ids"].tolist() == [[32.0, 32.0, 0.0, 0.0, 32.0, 32.0]]
    _, npe, _, npooled = pipe.encode_prompt("a red cube", do_classifier_free_guidance=True,
                                            negative_prompt="blurry")  # fmt: skip
    given = PromptEncoder(pipe, image_size=(32, 32), negative_prompt="blurry")(["a red cube"])
    torch.testing.assert_close(given.negative["prompt_embeds"], npe)
    torch.testing.assert_close(given.negative["text_embeds"], npooled)
    pipe.register_to_config(force_zeros_for_empty_prompt=False)  # then "" is encoded
    _, npe, _, _ = pipe.encode_prompt("a red cube", do_classifier_free_guidance=True)
    kept = PromptEncoder(pipe, image_size=(32, 32))(["a red cube"]).negative
    assert kept["prompt_embeds"].any()
    torch.testing.assert_close(kept["prompt_embeds"], npe)


def test_sdxl_added_embedding_width_is_checked_against_the_unet_config(replica):
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(replica("sdxl"), subfolder="unet")
    cond = {"prompt_embeds": torch.zeros(1, 77, 80), "text_embeds": torch.zeros(1, 40),
            "time_ids": torch.zeros(1, 5)}  # fmt: skip
    with pytest.raises(ValueError, match="projection_class_embeddings_input_dim"):
        predict(FAMILIES["unet"], unet, torch.zeros(1, 4, 4, 4), sigma=torch.zeros(1),
                timestep=torch.ones(1), cond=cond, negative=None,
                guidance_scale=torch.ones(1))  # fmt: skip
    with pytest.raises(ValueError, match=r"needs \['text_embeds', 'time_ids'\]"):
        predict(FAMILIES["unet"], unet, torch.zeros(1, 4, 4, 4), sigma=torch.zeros(1),
                timestep=torch.ones(1), cond={"prompt_embeds": torch.zeros(1, 77, 80)},
                negative=None, guidance_scale=torch.ones(1))  # fmt: skip


# ---- SANA: Gemma 2 with the complex human instruction and an attention mask --------------------


def test_sana_transformer_is_conditioned_as_the_pipeline_does(replica):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(replica("sana-1.6b"))
    calls, hook = _capture(pipe.transformer)
    pipe(prompt="a red cube", height=64, width=64, num_inference_steps=1, guidance_scale=1.0,
         output_type="latent", use_resolution_binning=False, max_sequence_length=8,
         generator=_gen())  # fmt: skip
    hook.remove()
    args, kwargs, expected = calls[0]
    enc = PromptEncoder(pipe, max_sequence_length=8)
    cond = enc(["a red cube"])
    torch.testing.assert_close(cond.embeds["prompt_embeds"], kwargs["encoder_hidden_states"])
    assert torch.equal(cond.embeds["prompt_attention_mask"], kwargs["encoder_attention_mask"])
    assert cond.embeds["prompt_embeds"].shape[1] == 8  # BOS + the last 7: the instruction dropped
    scale = pipe.transformer.config.timestep_scale
    pred = predict(FAMILIES["sana"], pipe.transformer, args[0], sigma=torch.zeros(1),
                   timestep=kwargs["timestep"] / scale, cond=cond.embeds, negative=None,
                   guidance_scale=torch.ones(1))  # fmt: skip
    torch.testing.assert_close(pred, expected)
    # the negative branch is encoded without the instruction, as the pipeline's
    assert len(_instruction(pipe)) > 1  # __call__'s default, which encode_prompt does not have
    _, _, npe, nmask = pipe.encode_prompt(
        "a red cube", negative_prompt="", max_sequence_length=8,
        complex_human_instruction=_instruction(pipe),
    )  # fmt: skip
    torch.testing.assert_close(cond.negative["prompt_embeds"], npe)
    assert torch.equal(cond.negative["prompt_attention_mask"], nmask)


def _instruction(pipe):
    import inspect

    return inspect.signature(type(pipe).__call__).parameters["complex_human_instruction"].default


# ---- Qwen-Image: Qwen2.5-VL over the prompt template, masks, true CFG ----------------------------


def _qwen_step(replica, prompt="a red cube", **call):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(replica("qwen-image"), dtype=torch.float32)
    calls, hook = _capture(pipe.transformer)
    # 2 steps: Qwen-Image's shift_terminal stretch divides by zero for one
    pipe(prompt=prompt, height=32, width=32, num_inference_steps=2, output_type="latent",
         max_sequence_length=64, generator=_gen(), **call)  # fmt: skip
    hook.remove()
    return pipe, calls


def test_qwen_image_transformer_is_conditioned_as_the_pipeline_does(replica):
    pipe, calls = _qwen_step(replica, true_cfg_scale=1.0)
    _, kwargs, expected = calls[0]
    enc = PromptEncoder(pipe, max_sequence_length=64)
    cond = enc(["a red cube"])
    # the template's 34 prefix tokens dropped: "a red cube" and the template's tail remain
    torch.testing.assert_close(cond.embeds["prompt_embeds"], kwargs["encoder_hidden_states"])
    assert cond.embeds["prompt_embeds_mask"].all()  # one prompt: no padding (pipeline: None)
    h = w = 32 // 8
    assert kwargs["img_shapes"] == [[(1, h // 2, w // 2)]]
    x = unpack_flux(kwargs["hidden_states"], h, w)  # [1, 16, 4, 4]
    pred = predict(FAMILIES["qwenimage"], pipe.transformer, x, sigma=torch.zeros(1),
                   timestep=kwargs["timestep"] * 1000, cond=cond.embeds, negative=None,
                   guidance_scale=torch.ones(1))  # fmt: skip
    torch.testing.assert_close(pack_flux(pred), expected)


def test_qwen_image_true_cfg_and_padded_rows_match_the_pipeline(replica):
    prompt = "two cups of coffee on a wooden table"
    pipe, calls = _qwen_step(replica, prompt, true_cfg_scale=4.0, negative_prompt="blurry")
    (_, kw_cond, out_cond), (_, kw_neg, out_neg) = calls[:2]
    # the pipeline's true CFG, by hand from its two calls: guided, then rescaled per token to the
    # conditional prediction's norm
    guided = out_neg + 4.0 * (out_cond - out_neg)  # [1, HW/4, 4C]
    expected = guided * out_cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True)
    enc = PromptEncoder(pipe, negative_prompt="blurry", max_sequence_length=64)
    cond = enc([prompt])
    # "blurry" is the shorter text: padded to one length, mask 0 on the padding
    assert kw_neg["encoder_hidden_states"].shape[1] < kw_cond["encoder_hidden_states"].shape[1]
    assert not cond.negative["prompt_embeds_mask"].all()
    x = unpack_flux(kw_cond["hidden_states"], 4, 4)
    pred = predict(FAMILIES["qwenimage"], pipe.transformer, x, sigma=torch.zeros(1),
                   timestep=kw_cond["timestep"] * 1000, cond=cond.embeds,
                   negative=cond.negative, guidance_scale=torch.full((1,), 4.0))  # fmt: skip
    torch.testing.assert_close(pack_flux(pred), expected, rtol=1e-4, atol=1e-5)
    # rows of two calls, of different text lengths, join (zero-padded, mask 0) and predict the
    # same as each alone
    long = enc(["a watercolor painting of a fox in a snowy forest"])
    both = FlowCondition.cat([cond, long])
    assert both.embeds["prompt_embeds"].shape[1] == long.embeds["prompt_embeds"].shape[1]
    xs = torch.randn(2, 16, 4, 4, generator=_gen())
    kw = dict(sigma=torch.zeros(2), timestep=torch.full((2,), 500.0), negative=None,
              guidance_scale=torch.ones(2))  # fmt: skip
    joined = predict(FAMILIES["qwenimage"], pipe.transformer, xs, cond=both.embeds, **kw)
    for i, c in enumerate((cond, long)):
        alone = predict(FAMILIES["qwenimage"], pipe.transformer, xs[i : i + 1], cond=c.embeds,
                        **{**kw, "sigma": kw["sigma"][:1], "timestep": kw["timestep"][:1],
                           "guidance_scale": kw["guidance_scale"][:1]})  # fmt: skip
        torch.testing.assert_close(joined[i : i + 1], alone, rtol=1e-4, atol=1e-5)


def test_ragged_rows_without_a_mask_are_refused():
    a = FlowCondition({"prompt_embeds": torch.zeros(1, 3, 4)})
    b = FlowCondition({"prompt_embeds": torch.zeros(1, 5, 4)})
    with pytest.raises(ValueError, match="only text of different lengths with its mask"):
        FlowCondition.cat([a, b])


# ---- refusal when the config is read ---------------------------------------------------------


def _raw(path, model_type="flow"):
    return {
        "workload": {"type": "images"},
        "model": {"type": model_type, "name_or_path": str(path)},
        "task": {"name": "image_prompts"},
        "algorithm": {"preset": "ddpo" if model_type == "unet" else "flow_grpo"},
    }


@pytest.fixture(scope="module")
def pixart(tmp_path_factory):
    """A real PixArtSigmaPipeline folder (a class grouprl does not train), tiny components."""
    from diffusers import (
        DPMSolverMultistepScheduler,
        PixArtSigmaPipeline,
        PixArtTransformer2DModel,
    )

    from grouprl.replicas.diffusion import kl_vae, t5_encoder, t5_tokenizer

    tok = t5_tokenizer()
    torch.manual_seed(0)
    transformer = PixArtTransformer2DModel(
        sample_size=8, num_layers=1, attention_head_dim=8, num_attention_heads=2, in_channels=4,
        out_channels=8, cross_attention_dim=16, caption_channels=32, norm_type="ada_norm_single",
    )  # fmt: skip
    pipe = PixArtSigmaPipeline(tokenizer=tok, text_encoder=t5_encoder(tok, 32, umt5=False, seed=1),
                               vae=kl_vae(4, 2), transformer=transformer,
                               scheduler=DPMSolverMultistepScheduler())  # fmt: skip
    folder = tmp_path_factory.mktemp("pixart")
    pipe.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("model_type", ["flow", "unet"])
def test_an_unsupported_pipeline_folder_is_refused_while_the_config_is_read(pixart, model_type):
    assert json.loads((pixart / "model_index.json").read_text())["_class_name"] == (
        "PixArtSigmaPipeline"
    )
    with pytest.raises(ConfigError) as err:
        validate(_raw(pixart, model_type))
    msg = str(err.value)
    assert "PixArtSigmaPipeline" in msg and "which grouprl does not train" in msg
    for name in ("StableDiffusionXLPipeline", "SanaPipeline", "QwenImagePipeline", "FluxPipeline"):
        assert name in msg


def test_a_pipeline_of_the_other_model_type_is_refused(replica):
    with pytest.raises(ConfigError, match="StableDiffusionXLPipeline, which runs with model.type "
                                          "'unet', not 'flow'"):  # fmt: skip
        validate(_raw(replica("sdxl"), "flow"))
    with pytest.raises(ConfigError, match="SanaPipeline, which runs with model.type 'flow'"):
        validate(_raw(replica("sana-1.6b"), "unet"))
    assert validate(_raw(replica("sdxl"), "unet")).model.type == "unet"


def test_a_hub_id_is_checked_once_its_model_index_is_downloaded(pixart, tmp_path, monkeypatch):
    """A hub id whose model_index.json is in huggingface_hub's cache is checked at validation;
    one not downloaded yet validates (the builder checks it right after the download)."""
    import huggingface_hub.constants as hub

    snapshot = tmp_path / "models--org--pixart" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "model_index.json").write_text((pixart / "model_index.json").read_text())
    (tmp_path / "models--org--pixart" / "refs").mkdir()
    (tmp_path / "models--org--pixart" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="'org/pixart' is a PixArtSigmaPipeline"):
        validate(_raw("org/pixart"))
    assert validate(_raw("org/not-downloaded")).model.name_or_path == "org/not-downloaded"


def test_the_builder_refuses_before_any_model_loads(pixart, monkeypatch):
    """The same check where the policy is built (a hub id validated before its download)."""
    import diffusers

    from grouprl.workloads.images.policy import _pipeline_parts

    loaded = []
    monkeypatch.setattr(diffusers.ModelMixin, "from_pretrained",
                        classmethod(lambda cls, *a, **k: loaded.append(cls)))  # fmt: skip
    cfg = validate(_raw("tiny"))  # a hub id that is not downloaded: passes validation
    m = cfg.model.model_copy(update={"name_or_path": str(pixart)})
    with pytest.raises(ValueError, match="is a PixArtSigmaPipeline"):
        _pipeline_parts(m)
    assert loaded == []


# ---- the config path: 2 steps, a checkpoint folder diffusers loads and runs -----------------------

SIDES = {"sdxl": 32, "sana-1.6b": 64, "qwen-image": 32}


@pytest.mark.slow  # 30-65 s each on 2 shared cores
@pytest.mark.parametrize("name", sorted(SIDES))
def test_two_steps_through_the_config_and_the_checkpoint_generates(replica, tmp_path, name):
    from diffusers import DiffusionPipeline

    from grouprl.runtime.checkpoint import CheckpointManager
    from grouprl.train import train

    unet, side = name == "sdxl", SIDES[name]
    raw = {
        "workload": {"type": "images"},
        "run": {"name": "run", "output_dir": str(tmp_path), "seed": 0, "device": "cpu",
                "console": False},
        "model": {"type": "unet" if unet else "flow", "name_or_path": str(replica(name)),
                  "max_sequence_length": 8, "lora": None},
        "task": {"name": "image_prompts", "options": {"source": "shapes", "n_eval": 2}},
        "rewards": [{"name": "color_area"}],
        "rollout": {"prompts_per_step": 1, "group_size": 2},
        "algorithm": {"preset": "ddpo" if unet else "flow_grpo", "kl_coef": 0.0},
        "diffusion": {"height": side, "width": side, "rollout_steps": 3, "eval_steps": 3,
                      "guidance_scale": 2.0},
        "train": {"steps": 2, "lr": 1e-3},
    }  # fmt: skip
    cfg = validate(raw)
    train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["split"] == "train"]
    assert len(rows) == 2 and all(r["grad_norm"] > 0 and r["skipped_nonfinite"] == 0 for r in rows)
    folder = CheckpointManager(tmp_path / "run").latest() / "model"
    sub = "unet" if unet else "transformer"
    dtype = torch.bfloat16 if name == "qwen-image" else torch.float32
    pipe = DiffusionPipeline.from_pretrained(folder, torch_dtype=dtype)
    original = DiffusionPipeline.from_pretrained(replica(name), torch_dtype=dtype)
    assert type(pipe) is type(original) and type(pipe.scheduler) is type(original.scheduler)
    trained, start = getattr(pipe, sub).state_dict(), getattr(original, sub).state_dict()
    assert any(not torch.equal(trained[k], v) for k, v in start.items())  # it did train
    call = {"sana-1.6b": {"use_resolution_binning": False, "max_sequence_length": 8}}.get(name, {})
    out = pipe(prompt="a red square", height=side, width=side, num_inference_steps=2,
               output_type="pt", generator=_gen(), **call)  # fmt: skip
    images = torch.as_tensor(out.images)
    assert images.shape == (1, 3, side, side) and torch.isfinite(images).all()


@pytest.mark.slow  # ~15 s each on 2 shared cores
@pytest.mark.parametrize("name", sorted(SIDES))
def test_lora_step_saves_a_file_the_pipeline_loads(replica, tmp_path, name):
    """The LoRA file of one step loads with the pipeline's own load_lora_weights (SDXL's UNet,
    SANA's and Qwen-Image's transformer keys). SANA's attention is attn1 / attn2 (as Wan's): the
    preset's joint-attention targets do not fit it, so its config names the projections."""
    from diffusers import DiffusionPipeline

    from grouprl.runtime.checkpoint import CheckpointManager
    from grouprl.train import train

    unet, side = name == "sdxl", SIDES[name]
    lora = {"r": 2, "alpha": 2}
    if name == "sana-1.6b":
        lora["target_modules"] = ["to_q", "to_k", "to_v", "to_out.0"]
    raw = {
        "workload": {"type": "images"},
        "run": {"name": "run", "output_dir": str(tmp_path), "seed": 0, "device": "cpu",
                "console": False},
        "model": {"type": "unet" if unet else "flow", "name_or_path": str(replica(name)),
                  "max_sequence_length": 8, "lora": lora},
        "task": {"name": "image_prompts", "options": {"source": "shapes", "n_eval": 1}},
        "rewards": [{"name": "color_area"}],
        "rollout": {"prompts_per_step": 1, "group_size": 2},
        "algorithm": {"preset": "ddpo" if unet else "flow_grpo", "kl_coef": 0.0},
        "diffusion": {"height": side, "width": side, "rollout_steps": 2, "eval_steps": 2},
        "train": {"steps": 1, "lr": 1e-2},
    }  # fmt: skip
    train(validate(raw))
    folder = CheckpointManager(tmp_path / "run").latest() / "model"
    pipe = DiffusionPipeline.from_pretrained(replica(name), dtype=torch.float32)
    pipe.load_lora_weights(folder)
    state = (pipe.unet if unet else pipe.transformer).state_dict()
    lora_b = [v for k, v in state.items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)  # trained (B starts at zero)
