"""The DDIM policy (FlowPolicy + DDIMRules, unet.ddim_policy; DDPO) on a tiny SD 1.x UNet built
from config: pipeline parity at eta 0, exact re-scoring at eta 1 with CFG, the DDIM schedule,
reference / KL, one train step, errors."""

from types import SimpleNamespace

import pytest
import torch

from grouprl.config.surrogates import ClipSurrogate
from grouprl.objectives import compute_advantages
from grouprl.objectives.objective import count_tokens, total_loss
from grouprl.policies.flow.tiny import tiny_unet, tiny_vae
from grouprl.policies.flow.types import FlowCondition
from grouprl.policies.flow.unet import DDPO_SCHEDULER, ddim_policy


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _policy(**kw):
    kw = {"latent_shape": (4, 8, 8), "vae": tiny_vae(sd3_factors=False), "rollout_steps": 5, **kw}
    return ddim_policy(tiny_unet(), **kw)


def _cond(b=2):
    g = _gen(5)
    return FlowCondition({"prompt_embeds": torch.randn(b, 7, 8, generator=g)},
                         {"prompt_embeds": torch.randn(1, 7, 8, generator=g)})  # fmt: skip


def test_eta_zero_sampling_equals_the_sd_pipeline():
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    pol, cond = _policy(guidance_scale=5.0), _cond()
    r = pol.sample(cond, 1, mode="eval", steps=5, generator=_gen())
    pipe = StableDiffusionPipeline(unet=pol.model, vae=pol.vae,
        scheduler=DDIMScheduler(**DDPO_SCHEDULER), text_encoder=None, tokenizer=None,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)  # fmt: skip
    kw = dict(prompt_embeds=cond.embeds["prompt_embeds"],
              negative_prompt_embeds=cond.negative["prompt_embeds"].expand(2, -1, -1),
              num_inference_steps=5, guidance_scale=5.0, height=8, width=8, eta=0.0)  # fmt: skip
    lat = pipe(latents=r.actions.latents[:, 0].clone(), output_type="latent", **kw).images
    assert torch.equal(lat, r.actions.final)
    img = pipe(latents=r.actions.latents[:, 0].clone(), output_type="pt", **kw).images
    torch.testing.assert_close(pol.decode(r.actions.final), img, rtol=0, atol=1e-6)


def test_ddim_schedule_slots():
    from diffusers import DDIMScheduler

    sched = DDIMScheduler(**DDPO_SCHEDULER)
    sched.set_timesteps(4)  # leading spacing, offset 1: [751, 501, 251, 1]
    cols = _policy().rules.set_timesteps(4)
    assert cols["timesteps"].tolist() == [751.0, 501.0, 251.0, 1.0, 0.0]
    ac = sched.alphas_cumprod
    expected = torch.stack([ac[751], ac[501], ac[251], ac[1], sched.final_alpha_cumprod])
    torch.testing.assert_close(cols["alphas"], expected.float())
    torch.testing.assert_close(cols["sigmas"], (1 - expected.float()).sqrt())


def test_eta_one_ratio_exactly_one_and_reference_kl():
    pol, cond = _policy(guidance_scale=5.0, lora={"r": 4, "alpha": 4}), _cond()
    r = pol.sample(cond, 3, generator=_gen())
    assert r.old_logp.shape == (6, 5) and r.mask.sum() == 6 * 4
    assert bool((r.old_logp[r.mask] != 0).all())
    out = pol.log_probs(r.actions)
    assert torch.equal(out.logp.detach(), r.old_logp)
    assert not pol.reference_kl(r.actions, out).any()
    g = _gen(1)
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    out = pol.log_probs(r.actions)
    kl = pol.reference_kl(r.actions, out)
    with pol.reference() as ref:
        ref_out = ref.log_probs(r.actions)
    d = (out.extras["mean"] - ref_out.extras["mean"]).pow(2).flatten(2).mean(-1)  # [n, K]
    expected = torch.where(r.mask, d / (2 * out.extras["std"].clamp(min=1e-12) ** 2), 0.0)
    torch.testing.assert_close(kl, expected.detach())  # exact KL: / (2 std^2)
    assert bool((kl[r.mask] > 0).all())


def test_one_train_step():
    pol = _policy(guidance_scale=5.0, lora={"r": 4, "alpha": 4}, rollout_steps=4)
    r = pol.sample(_cond(), 4, generator=_gen())
    images = pol.decode(r.actions.final)  # [N, 3, H, W]
    r.rewards = {"brightness": images.mean((1, 2, 3))}
    adv = compute_advantages("grpo", r.rewards, r.group_ids, weights={"brightness": 1.0},
                             reward_aggregation="sum_then_normalize", scale="group", eps=1e-6)  # fmt: skip
    algo = SimpleNamespace(
        ratio_level="token", surrogate=ClipSurrogate(eps_low=1e-4, eps_high=1e-4),
        aggregation="token_mean", kl_coef=0.0,
        kl_estimator="k3", kl_mode="loss", entropy_coef=0.0, top_entropy_quantile=1.0,
        engine_correction="none", engine_correction_max=2.0, engine_correction_min=0.0,
    )  # fmt: skip
    params = pol.trainable_parameters()
    before = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-2)
    pol.train()
    out = pol.log_probs(r.actions)
    res = total_loss(out, old_logp=r.old_logp, advantages=adv, mask=r.mask, algo=algo,
                     counts=count_tokens(r.mask), kl_out=pol.reference_kl(r.actions, out))  # fmt: skip
    assert torch.isfinite(res.loss)
    res.loss.backward()
    opt.step()
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, params))


def test_errors():
    with pytest.raises(ValueError, match="flow-matching"):
        _policy().forward_noising(torch.zeros(1, 4, 8, 8), torch.tensor([0.5]),
                                  torch.zeros(1, 4, 8, 8), _cond(1))  # fmt: skip
    with pytest.raises(ValueError, match="kl_form"):
        _policy(kl_form="flow_grpo")
    with pytest.raises(ValueError, match="sampler must be one of"):
        _policy(sampler="flow_sde")
