"""LoRA interop with diffusers: files written by FlowPolicy.save_pretrained (flow and DDIM rules)
load into diffusers pipelines (`load_lora_weights`) and models (`from_pretrained`) and give the policy's
outputs; round trips through load_saved_weights; mismatches fail loudly."""

import json

import pytest
import torch

from grouprl.policies.flow.lora import LORA_FILE
from grouprl.policies.flow.policy import FlowPolicy
from grouprl.policies.flow.text_encoders import PromptEncoder
from grouprl.policies.flow.tiny import (
    tiny_flux_transformer,
    tiny_sd3_transformer,
    tiny_text_components,
    tiny_unet,
    tiny_vae,
)
from grouprl.policies.flow.unet import ddim_policy


def _perturb_lora(policy, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))


def _sd3_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(2, 4, 8, 8, generator=g),
                timestep=torch.tensor([700.0, 250.0]),
                encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
                pooled_projections=torch.randn(2, 64, generator=g))  # fmt: skip


def test_sd3_lora_loads_into_a_full_tiny_pipeline(tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    pol = FlowPolicy(tiny_sd3_transformer(), latent_shape=(4, 8, 8), vae=tiny_vae(),
                     scheduler_config={"shift": 3.0}, lora={"r": 4, "alpha": 16})  # fmt: skip
    _perturb_lora(pol)
    inputs = _sd3_inputs()
    ours = pol.model(**inputs).sample
    base = tiny_sd3_transformer()(**inputs).sample
    assert not torch.allclose(ours, base, atol=1e-3)  # the adapter matters
    pol.save_pretrained(tmp_path)
    assert (tmp_path / LORA_FILE).is_file() and not (tmp_path / "transformer").exists()
    meta = json.loads((tmp_path / "grouprl_flow.json").read_text())
    assert meta["family"] == "sd3" and meta["lora"]["alpha"] == 16

    # a whole tiny SD3 pipeline built from config: transformer, VAE, scheduler, CLIP/T5 + tokenizers
    pipe = StableDiffusion3Pipeline(transformer=tiny_sd3_transformer(), vae=tiny_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), **tiny_text_components("sd3"))  # fmt: skip
    pipe.load_lora_weights(tmp_path)
    torch.testing.assert_close(pipe.transformer(**inputs).sample, ours, rtol=0, atol=0)

    # end to end: same prompt, same initial noise, ODE sampling with CFG -> the same latents
    enc = PromptEncoder(pipe, "sd3", max_sequence_length=8)
    pol.prompt_encoder, pol.guidance_scale = enc, 3.0
    r = pol.sample(
        ["a red cube"], 1, mode="eval", steps=3, generator=torch.Generator().manual_seed(0)
    )
    lat = pipe(prompt="a red cube", latents=r.actions.latents[:, 0].clone(), num_inference_steps=3,
               guidance_scale=3.0, height=8, width=8, max_sequence_length=8,
               output_type="latent").images  # fmt: skip
    # the encoder runs the prompt and "" in one text-encoder batch, the pipeline one at a time:
    # float rounding of the embeddings only
    torch.testing.assert_close(lat, r.actions.final, rtol=0, atol=1e-5)


def test_merged_and_full_weights_load_with_from_pretrained(tmp_path):
    from diffusers import SD3Transformer2DModel

    pol = FlowPolicy(tiny_sd3_transformer(), latent_shape=(4, 8, 8), lora={"r": 4, "alpha": 8})
    _perturb_lora(pol)
    inputs = _sd3_inputs(1)
    ours = pol.model(**inputs).sample
    pol.save_pretrained(tmp_path / "lora", merge_lora=True)
    merged = SD3Transformer2DModel.from_pretrained(tmp_path / "lora" / "transformer")
    torch.testing.assert_close(merged(**inputs).sample, ours, rtol=0, atol=1e-5)

    full = FlowPolicy(tiny_sd3_transformer(), latent_shape=(4, 8, 8))  # full fine-tuning
    with torch.no_grad():
        full.trainable_parameters()[0].add_(0.5)
    full.save_pretrained(tmp_path / "full")
    assert not (tmp_path / "full" / LORA_FILE).exists()
    loaded = SD3Transformer2DModel.from_pretrained(tmp_path / "full" / "transformer")
    torch.testing.assert_close(loaded(**inputs).sample, full.model(**inputs).sample, rtol=0, atol=0)
    fresh = FlowPolicy(tiny_sd3_transformer(), latent_shape=(4, 8, 8))
    fresh.load_saved_weights(tmp_path / "full")
    assert torch.equal(fresh.trainable_parameters()[0], full.trainable_parameters()[0])
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path / "full" / "scheduler")
    assert sched.config.shift == 1.0  # the policy's (default) scheduler config


def test_lora_round_trip_and_mismatches(tmp_path):
    pol = FlowPolicy(tiny_sd3_transformer(), latent_shape=(4, 8, 8), lora={"r": 4, "alpha": 8})
    _perturb_lora(pol)
    pol.save_pretrained(tmp_path)
    again = FlowPolicy(tiny_sd3_transformer(), latent_shape=(4, 8, 8), lora={"r": 4, "alpha": 8})
    again.load_saved_weights(tmp_path)
    inputs = _sd3_inputs(2)
    torch.testing.assert_close(again.model(**inputs).sample, pol.model(**inputs).sample,
                               rtol=0, atol=0)  # fmt: skip
    other_alpha = FlowPolicy(
        tiny_sd3_transformer(), latent_shape=(4, 8, 8), lora={"r": 4, "alpha": 4}
    )
    with pytest.raises(ValueError, match="alpha"):
        other_alpha.load_saved_weights(tmp_path)
    other_rank = FlowPolicy(
        tiny_sd3_transformer(), latent_shape=(4, 8, 8), lora={"r": 2, "alpha": 8}
    )
    with pytest.raises(ValueError, match="rank"):
        other_rank.load_saved_weights(tmp_path)
    fewer = FlowPolicy(tiny_sd3_transformer(), latent_shape=(4, 8, 8),
                       lora={"r": 4, "alpha": 8, "target_modules": ["to_q"]})  # fmt: skip
    with pytest.raises(ValueError, match="does not match"):
        fewer.load_saved_weights(tmp_path)
    with pytest.raises(FileNotFoundError, match=LORA_FILE):
        again.load_saved_weights(tmp_path / "nowhere")


def test_flux_lora_loads_into_the_flux_pipeline(tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    pol = FlowPolicy(tiny_flux_transformer(), latent_shape=(1, 8, 8), lora={"r": 4, "alpha": 8})
    _perturb_lora(pol)
    pol.save_pretrained(tmp_path)
    pipe = FluxPipeline(transformer=tiny_flux_transformer(), vae=tiny_vae(latent_channels=1),
                        scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder=None,
                        tokenizer=None, text_encoder_2=None, tokenizer_2=None)  # fmt: skip
    pipe.load_lora_weights(tmp_path)
    g = torch.Generator().manual_seed(0)
    kw = dict(hidden_states=torch.randn(1, 16, 4, generator=g), timestep=torch.tensor([0.6]),
              encoder_hidden_states=torch.randn(1, 5, 32, generator=g),
              pooled_projections=torch.randn(1, 32, generator=g), txt_ids=torch.zeros(5, 3),
              img_ids=torch.zeros(16, 3))  # fmt: skip
    torch.testing.assert_close(
        pipe.transformer(**kw).sample, pol.model(**kw).sample, rtol=0, atol=0
    )


def test_unet_lora_loads_into_the_sd_pipeline(tmp_path):
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    pol = ddim_policy(tiny_unet(), latent_shape=(4, 8, 8), lora={"r": 4, "alpha": 4})
    _perturb_lora(pol)
    pol.save_pretrained(tmp_path)
    pipe = StableDiffusionPipeline(unet=tiny_unet(), vae=tiny_vae(sd3_factors=False),
        scheduler=DDIMScheduler(), text_encoder=None, tokenizer=None, safety_checker=None,
        feature_extractor=None, requires_safety_checker=False)  # fmt: skip
    pipe.load_lora_weights(tmp_path)
    g = torch.Generator().manual_seed(0)
    x, emb = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 7, 8, generator=g)
    t = torch.tensor([900, 100])
    torch.testing.assert_close(pipe.unet(x, t, encoder_hidden_states=emb).sample,
                               pol.model(x, t, encoder_hidden_states=emb).sample, rtol=0, atol=0)  # fmt: skip


def test_user_module_lora_file_round_trip(tmp_path):
    class Velocity(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.to_q, self.to_out = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

        def forward(self, x, sigma):
            return self.to_out(torch.tanh(self.to_q(x.permute(0, 2, 3, 1)))).permute(0, 3, 1, 2)

    def build():
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return FlowPolicy(Velocity(), latent_shape=(4, 2, 2),
                              lora={"r": 2, "alpha": 4, "target_modules": ["to_q"]})  # fmt: skip

    pol = build()
    _perturb_lora(pol)
    pol.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / LORA_FILE), framework="pt") as f:
        assert sorted(f.keys()) == [
            "transformer.to_q.lora_A.weight",
            "transformer.to_q.lora_B.weight",
        ]
    again = build()
    again.load_saved_weights(tmp_path)
    x = torch.randn(3, 4, 2, 2)
    torch.testing.assert_close(again.model(x, None), pol.model(x, None), rtol=0, atol=0)
    pol.save_pretrained(tmp_path / "merged", merge_lora=True)
    plain = Velocity()
    from safetensors.torch import load_file

    plain.load_state_dict(load_file(str(tmp_path / "merged" / "transformer" / "model.safetensors")))
    torch.testing.assert_close(plain(x, None), pol.model(x, None), rtol=0, atol=1e-6)
