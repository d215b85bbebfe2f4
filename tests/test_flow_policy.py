"""FlowPolicy on tiny diffusers SD3 / FLUX / Wan transformers and a user velocity module (built from
config, diffusers' own test sizes): pipeline parity, exact re-scoring, reference / KL, step
selection, shared noise, denoising reduction, CFG at training, forward noising, one train step."""

import pytest
import torch

from grouprl.config.surrogates import ClipSurrogate
from grouprl.objectives import compute_advantages
from grouprl.objectives.objective import count_tokens, total_loss
from grouprl.policies.flow.policy import FlowPolicy, latent_shape_for
from grouprl.policies.flow.text_encoders import PromptEncoder, class_condition
from grouprl.policies.flow.tiny import (
    tiny_flux_transformer,
    tiny_sd3_transformer,
    tiny_text_components,
    tiny_vae,
    tiny_wan_transformer,
    tiny_wan_vae,
)
from grouprl.policies.flow.types import FlowCondition

SD3_SCHED = {"shift": 3.0}
FLUX_SCHED = {"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _sd3_cond(b=2, seed=0):
    g = _gen(seed)
    pos = {"prompt_embeds": torch.randn(b, 7, 32, generator=g),
           "pooled_prompt_embeds": torch.randn(b, 64, generator=g)}  # fmt: skip
    neg = {"prompt_embeds": torch.randn(1, 7, 32, generator=g),
           "pooled_prompt_embeds": torch.randn(1, 64, generator=g)}  # fmt: skip
    return FlowCondition(pos, neg)


def _flux_cond(b=2):
    g = _gen(1)
    return FlowCondition({"prompt_embeds": torch.randn(b, 7, 32, generator=g),
                          "pooled_prompt_embeds": torch.randn(b, 32, generator=g)})  # fmt: skip


def _sd3(**kw):
    kw = {"latent_shape": (4, 8, 8), "vae": tiny_vae(), "scheduler_config": SD3_SCHED,
          "rollout_steps": 4, "eval_steps": 6, **kw}  # fmt: skip
    return FlowPolicy(tiny_sd3_transformer(), **kw)


def _flux(**kw):
    kw = {"latent_shape": (1, 8, 8), "vae": tiny_vae(latent_channels=1),
          "scheduler_config": FLUX_SCHED, "rollout_steps": 4, **kw}  # fmt: skip
    return FlowPolicy(tiny_flux_transformer(), **kw)


class ClassVelocity(torch.nn.Module):
    """A tiny class-conditional velocity model with the documented call: model(x, sigma, **cond)."""

    def __init__(self, classes=3, channels=3):
        super().__init__()
        self.embed = torch.nn.Embedding(classes + 1, 8)  # + the null class
        self.to_q = torch.nn.Linear(channels + 9, 16)
        self.out = torch.nn.Linear(16, channels)

    def forward(self, x, sigma, class_labels):
        b, c, h, w = x.shape
        feats = torch.cat([self.embed(class_labels), sigma[:, None].to(x.dtype)], 1)  # [B, 9]
        feats = feats[:, :, None, None].expand(b, 9, h, w)
        z = torch.cat([x, feats], 1).permute(0, 2, 3, 1)  # [B, H, W, C + 9]
        return self.out(torch.tanh(self.to_q(z))).permute(0, 3, 1, 2)


def module_policy(**kw):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = ClassVelocity()
    return FlowPolicy(model, latent_shape=(3, 4, 4), rollout_steps=3, **kw)


def _perturb(params, scale=0.1, seed=1):
    g = _gen(seed)
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn(p.shape, generator=g))


# ---- parity with the diffusers pipelines -------------------------------------------------------


def test_sd3_eval_sampling_equals_the_pipeline():
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    pol, cond = _sd3(guidance_scale=4.5), _sd3_cond()
    r = pol.sample(cond, 1, mode="eval", steps=4, generator=_gen())
    pipe = StableDiffusion3Pipeline(
        transformer=pol.model, vae=pol.vae, scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHED),
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
        text_encoder_3=None, tokenizer_3=None,
    )  # fmt: skip
    kw = dict(
        prompt_embeds=cond.embeds["prompt_embeds"],
        pooled_prompt_embeds=cond.embeds["pooled_prompt_embeds"],
        negative_prompt_embeds=cond.negative["prompt_embeds"].expand(2, -1, -1),
        negative_pooled_prompt_embeds=cond.negative["pooled_prompt_embeds"].expand(2, -1),
        num_inference_steps=4, guidance_scale=4.5, height=8, width=8,
    )  # fmt: skip
    x0 = r.actions.latents[:, 0]
    lat = pipe(latents=x0.clone(), output_type="latent", **kw).images
    assert torch.equal(lat, r.actions.final)
    img = pipe(latents=x0.clone(), output_type="pt", **kw).images
    torch.testing.assert_close(pol.decode(r.actions.final), img, rtol=0, atol=1e-6)
    assert not r.mask.any() and not r.old_logp.any()  # eval: nothing trained


def test_flux_eval_sampling_equals_the_pipeline():
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    from grouprl.policies.flow.models import pack_flux, unpack_flux

    pol, cond = _flux(), _flux_cond()
    r = pol.sample(cond, 1, mode="eval", steps=3, generator=_gen())
    pipe = FluxPipeline(
        transformer=pol.model, vae=pol.vae, scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHED),
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
    )  # fmt: skip
    lat = pipe(
        prompt_embeds=cond.embeds["prompt_embeds"],
        pooled_prompt_embeds=cond.embeds["pooled_prompt_embeds"],
        latents=pack_flux(r.actions.latents[:, 0].clone()), num_inference_steps=3, height=8,
        width=8, output_type="latent",
    ).images  # fmt: skip
    assert torch.equal(unpack_flux(lat, 8, 8), r.actions.final)
    x = torch.randn(2, 5, 4, 6)
    assert torch.equal(unpack_flux(pack_flux(x), 4, 6), x)


# ---- exact re-scoring, reference, KL -----------------------------------------------------------


@pytest.mark.parametrize("which", ["sd3_cfg", "flux", "module_cfg"])
def test_on_policy_ratio_is_exactly_one(which):
    if which == "sd3_cfg":
        pol, cond = _sd3(guidance_scale=4.5, lora={"r": 4, "alpha": 8}), _sd3_cond()
    elif which == "flux":
        pol, cond = _flux(sampler="dance_sde", noise_level=0.3), _flux_cond()
    else:
        pol, cond = module_policy(guidance_scale=2.0), class_condition([0, 2], null_label=3)
    r = pol.sample(cond, 3, generator=_gen())
    k = r.actions.num_steps
    assert r.old_logp.shape == (6, k) and r.mask.shape == (6, k) and r.mask.sum() == 6 * (k - 1)
    assert bool((r.old_logp[r.mask] != 0).all()) and not r.old_logp[~r.mask].any()
    out = pol.log_probs(r.actions, temperature=1.0, with_entropy=True)  # loop kwargs are ignored
    assert out.logp.requires_grad and out.entropy is None
    assert torch.equal(out.logp.detach(), r.old_logp)  # ratio exp(0) = 1 exactly, fp32
    # a minibatch of the rollout: a different batch size may change the kernels' float rounding
    sub = r.select([0, 4, 5])
    torch.testing.assert_close(pol.log_probs(sub.actions).logp.detach(), sub.old_logp, rtol=0,
                               atol=1e-5)  # fmt: skip
    assert out.extras["mean"].shape == (6, k, *pol.latent_shape)
    assert bool((out.extras["std"][r.mask] > 0).all()) and not out.extras["std"][~r.mask].any()


def test_store_means_equal_rescored_means():
    pol = _sd3()
    r = pol.sample(_sd3_cond(), 2, generator=_gen(), store_means=True)
    out = pol.log_probs(r.actions)
    mask = r.mask[:, :, None, None, None]
    assert torch.equal(out.extras["mean"].detach(), r.actions.old_mean * mask)


def test_lora_reference_equals_base_model_and_kl():
    pol, cond = _sd3(lora={"r": 4, "alpha": 8}), _sd3_cond()
    base = _sd3()  # same seed: the same base weights, no adapter
    r = pol.sample(cond, 2, generator=_gen())
    out = pol.log_probs(r.actions)
    torch.testing.assert_close(pol.reference_kl(r.actions, out), torch.zeros(4, 4), rtol=0, atol=0)
    _perturb(pol.trainable_parameters())  # B != 0: the adapter now changes the output
    out = pol.log_probs(r.actions)
    with pol.reference() as ref:
        ref_out = ref.log_probs(r.actions)
    assert not ref_out.logp.requires_grad
    torch.testing.assert_close(ref_out.logp, base.log_probs(r.actions).logp.detach())
    kl = pol.kl(out, ref_out)
    assert kl.shape == (4, 4) and bool((kl[r.mask] > 0).all()) and not kl[~r.mask].any()
    # kl_form flow_grpo divides by g^2 = std^2 / (sigma_k - sigma_k+1); exact by std^2
    gap = r.actions.sigmas[:, :-1] - r.actions.sigmas[:, 1:]
    exact = _sd3(lora={"r": 4, "alpha": 8}, kl_form="exact")
    exact.model.load_state_dict(pol.model.state_dict())
    kl_exact = exact.reference_kl(r.actions, exact.log_probs(r.actions))
    torch.testing.assert_close(kl_exact * gap * r.mask, kl, rtol=1e-5, atol=0)
    assert all(p.requires_grad for p in pol.trainable_parameters())  # restored after reference


def test_full_finetuning_reference_is_a_lazy_frozen_copy():
    pol, cond = module_policy(), class_condition([0, 1])
    assert pol.weights._ref_model is None
    r = pol.sample(cond, 2, generator=_gen())
    out = pol.log_probs(r.actions)
    assert not pol.reference_kl(r.actions, out).any()
    assert pol.weights._ref_model is not None
    assert not any(p.requires_grad for p in pol.weights._ref_model.parameters())
    _perturb(pol.trainable_parameters())
    kl = pol.reference_kl(r.actions, pol.log_probs(r.actions))
    assert bool((kl[r.mask] > 0).all())


def test_scoring_a_subset_of_steps_and_batch_records():
    pol = _sd3(guidance_scale=2.0)
    r = pol.sample(_sd3_cond(), 2, generator=_gen())
    full = pol.log_probs(r.actions).logp.detach()
    part = pol.log_probs(r.actions, steps=[1]).logp.detach()
    assert torch.equal(part[:, 1], full[:, 1]) and not part[:, [0, 2, 3]].any()
    b = r.actions
    assert b.lengths.tolist() == [3] * 4 and not b.truncated.any()
    other = pol.sample(_sd3_cond(), 1, generator=_gen(9)).actions
    both = type(b).cat([b, other])
    assert len(both) == 6 and torch.equal(both.latents[4:], other.latents)
    assert torch.equal(
        both.cond.negative["prompt_embeds"][5], other.cond.negative["prompt_embeds"][1]
    )
    # the same rows scored in a batch of 6 and of 2: equal up to float32 rounding (the CPU's
    # matmul kernels block differently by batch size, so bit equality is not promised)
    torch.testing.assert_close(
        pol.log_probs(both).logp.detach()[4:], pol.log_probs(other).logp.detach(),
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip
    with pytest.raises(ValueError, match="number of steps"):
        type(b).cat([b, pol.sample(_sd3_cond(), 1, steps=2, generator=_gen()).actions])
    with pytest.raises(ValueError, match="first"):
        FlowCondition(
            {"prompt_embeds": torch.zeros(2, 3, 4), "pooled_prompt_embeds": torch.zeros(3, 4)}
        )
    with pytest.raises(ValueError, match="negative keys"):
        FlowCondition({"prompt_embeds": torch.zeros(2, 3, 4)}, {"other": torch.zeros(1, 3, 4)})


# ---- step selection, shared noise, denoising reduction, CFG at training -----------------------


def test_window_selection_ode_outside_the_window():
    pol = _sd3(rollout_steps=6, steps={"name": "random_window", "window_size": 2})
    r = pol.sample(_sd3_cond(), 3, generator=_gen())
    b = r.actions
    assert torch.equal(b.train_mask, b.stochastic) and b.train_mask.sum(1).tolist() == [2] * 6
    assert not r.old_logp[~r.mask].any() and bool((r.old_logp[r.mask] != 0).all())
    # a deterministic step is the Euler step x + (sigma_next - sigma) v of the stored latents
    row, k = 0, int((~b.stochastic[0]).nonzero()[0])
    with torch.no_grad():
        v = pol.predict(pol.model, b.latents[:, k], {"sigmas": b.sigmas, "timesteps": b.timesteps},
                         k, b.cond, b.guidance_scale)  # fmt: skip
    expected = b.latents[row, k] + (b.sigmas[row, k + 1] - b.sigmas[row, k]) * v[row]
    torch.testing.assert_close(b.latents[row, k + 1], expected, rtol=0, atol=1e-6)


def test_sliding_window_follows_the_optimizer_step():
    steps = {"name": "sliding_window", "window_size": 2, "shift_every": 3}
    pol = _sd3(rollout_steps=6, steps=steps)
    early = pol.sample(_sd3_cond(), 1, generator=_gen(), optimizer_step=2)
    late = pol.sample(_sd3_cond(), 1, generator=_gen(), optimizer_step=7)  # moved twice
    assert early.mask[0].nonzero().flatten().tolist() == [0, 1]
    assert late.mask[0].nonzero().flatten().tolist() == [2, 3]


def test_shared_initial_noise_within_groups():
    pol = _sd3(initial_noise="shared")
    r = pol.sample(_sd3_cond(3), 4, generator=_gen(), group_ids=[10, 11, 12])
    x0 = r.actions.latents[:, 0]
    assert r.group_ids.tolist() == [10] * 4 + [11] * 4 + [12] * 4
    for g in range(3):
        assert all(torch.equal(x0[4 * g], x0[4 * g + i]) for i in range(4))
        assert not torch.equal(r.actions.final[4 * g], r.actions.final[4 * g + 1])  # SDE noise
    assert not torch.allclose(x0[0], x0[4]) and not torch.allclose(x0[4], x0[8])


def test_denoising_reduction_and_chunking():
    pol = _sd3(rollout_steps=3, eval_steps=8)
    train = pol.sample(_sd3_cond(), 2, generator=_gen())
    ev = pol.sample(_sd3_cond(), 2, generator=_gen(), mode="eval")
    assert train.actions.latents.shape[1] == 4 and train.old_logp.shape == (4, 3)
    assert (
        ev.actions.latents.shape[1] == 9 and not ev.mask.any() and not ev.actions.stochastic.any()
    )
    torch.testing.assert_close(ev.actions.sigmas[0], _sd3().rules.set_timesteps(8)["sigmas"])
    chunked = pol.sample(_sd3_cond(), 2, generator=_gen(), mode="eval", chunk_size=1)
    torch.testing.assert_close(chunked.actions.final, ev.actions.final, rtol=0, atol=1e-6)


def test_training_without_cfg_scores_the_conditional_branch():
    pol = _sd3(guidance_scale=4.0)
    r = pol.sample(_sd3_cond(), 2, generator=_gen())
    pol.train_cfg = "none"
    no_cfg = pol.log_probs(r.actions).logp.detach()
    assert not torch.equal(no_cfg[r.mask], r.old_logp[r.mask])  # the guided rollout is off-policy
    b = r.actions
    b1 = type(b)(**{**b.__dict__, "guidance_scale": torch.ones(4)})
    pol.train_cfg = "same"
    torch.testing.assert_close(pol.log_probs(b1).logp.detach(), no_cfg, rtol=0, atol=0)
    pol.guidance_scale = 4.0
    with pytest.raises(ValueError, match="negative"):
        pol.sample(FlowCondition(_sd3_cond().embeds), 1)


# ---- forward noising and old weights -----------------------------------------------------------


def test_forward_noising_current_old_and_reference():
    pol = _sd3(lora={"r": 4, "alpha": 8})
    cond, g = _sd3_cond(), _gen(3)
    x0, noise = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    t = torch.tensor([0.3, 0.8])
    v = pol.forward_noising(x0, t, noise, cond)
    assert v.shape == (2, 4, 8, 8) and v.requires_grad
    xt = 0.7 * x0[0] + 0.3 * noise[0]  # (1 - t) x0 + t eps for row 0
    base = tiny_sd3_transformer()(hidden_states=xt[None], timestep=torch.tensor([300.0]),
        encoder_hidden_states=cond.embeds["prompt_embeds"][:1],
        pooled_projections=cond.embeds["pooled_prompt_embeds"][:1]).sample  # fmt: skip
    torch.testing.assert_close(v[:1].detach(), base, rtol=0, atol=1e-6)  # B = 0 at init
    with pytest.raises(ValueError, match="update_old"):
        pol.forward_noising(x0, t, noise, cond, which="old")
    pol.update_old(0.5)  # first call: old = current
    params = pol.trainable_parameters()
    before = [p.detach().clone() for p in params]
    _perturb(params)
    old_v = pol.forward_noising(x0, t, noise, cond, which="old")
    torch.testing.assert_close(old_v, v.detach(), rtol=0, atol=0)
    assert not old_v.requires_grad and all(p.requires_grad for p in params)
    ref_v = pol.forward_noising(x0, t, noise, cond, which="ref")
    torch.testing.assert_close(ref_v, v.detach(), rtol=0, atol=1e-6)  # the base model
    assert not torch.allclose(pol.forward_noising(x0, t, noise, cond).detach(), v.detach())
    pol.update_old(0.25)  # old <- 0.25 old + 0.75 current
    p0 = params[0]
    torch.testing.assert_close(pol.weights._old[next(iter(pol.weights.trainable()))],
                               0.25 * before[0] + 0.75 * p0.detach())  # fmt: skip
    # state_dict carries the old weights; a round trip restores them
    state = pol.state_dict()
    assert any(k.startswith("old::") for k in state)
    other = _sd3(lora={"r": 4, "alpha": 8})
    other.load_state_dict(state)
    torch.testing.assert_close(other.forward_noising(x0, t, noise, cond, which="old"),
                               pol.forward_noising(x0, t, noise, cond, which="old"))  # fmt: skip
    with pytest.raises(KeyError, match="missing"):
        other.load_state_dict({k: v for k, v in state.items() if "to_q" not in k})


# ---- one full train step -----------------------------------------------------------------------


def _train_step(pol, cond, steps=None):
    from types import SimpleNamespace

    r = pol.sample(cond, 3, generator=_gen())
    images = pol.decode(r.actions.final)  # [N, 3, H, W] in [0, 1]
    assert images.min() >= 0 and images.max() <= 1
    rewards = images.flatten(2).mean(-1)[:, 0] - images.flatten(2).mean(-1)[:, 2]  # red - blue
    r.rewards = {"redness": rewards}
    adv = compute_advantages("grpo", r.rewards, r.group_ids, weights={"redness": 1.0},
                             reward_aggregation="sum_then_normalize", scale="group", eps=1e-4)  # fmt: skip
    algo = SimpleNamespace(
        ratio_level="token", surrogate=ClipSurrogate(eps_low=1e-4, eps_high=1e-4),
        aggregation="token_mean", kl_coef=0.04,
        kl_estimator="k3", kl_mode="loss", entropy_coef=0.0, top_entropy_quantile=1.0,
        engine_correction="none", engine_correction_max=2.0, engine_correction_min=0.0,
    )  # fmt: skip
    params = pol.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=1e-2)
    before = [p.detach().clone() for p in params]
    pol.train()
    out = pol.log_probs(r.actions)
    kl = pol.reference_kl(r.actions, out)
    res = total_loss(out, old_logp=r.old_logp, advantages=adv, mask=r.mask, algo=algo,
                     counts=count_tokens(r.mask), kl_out=kl)  # fmt: skip
    assert torch.isfinite(res.loss) and res.metrics["kl"] == 0.0
    res.loss.backward()
    opt.step()
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, params))
    assert pol.reference_kl(r.actions, pol.log_probs(r.actions))[r.mask].sum() > 0
    return res


@pytest.mark.parametrize("which", ["sd3", "flux", "module"])
def test_one_train_step(which):
    if which == "sd3":
        _train_step(_sd3(guidance_scale=3.0, lora={"r": 4, "alpha": 8}), _sd3_cond())
    elif which == "flux":
        _train_step(_flux(lora={"r": 4, "alpha": 8}), _flux_cond())
    else:
        _train_step(module_policy(guidance_scale=2.0), class_condition([0, 1], null_label=3))


# ---- video, text conditioning, errors ----------------------------------------------------------


def test_wan_video_shapes_and_exact_rescoring():
    model, vae = tiny_wan_transformer(), tiny_wan_vae()
    shape = latent_shape_for(model, vae, 16, 16, num_frames=5)
    assert shape == (16, 2, 2, 2)  # frames (5 - 1) // 4 + 1, spatial / 8
    pol = FlowPolicy(model, latent_shape=shape, vae=vae, scheduler_config={"shift": 7.0},
                     rollout_steps=3, lora={"r": 2, "alpha": 4})  # fmt: skip
    cond = FlowCondition({"prompt_embeds": torch.randn(2, 6, 32, generator=_gen())})
    r = pol.sample(cond, 2, generator=_gen())
    assert r.actions.latents.shape == (4, 4, 16, 2, 2, 2) and r.old_logp.shape == (4, 3)
    assert torch.equal(pol.log_probs(r.actions).logp.detach(), r.old_logp)
    assert pol.decode(r.actions.final).shape == (4, 3, 5, 16, 16)
    with pytest.raises(ValueError, match="num_frames"):
        latent_shape_for(model, vae, 16, 16)


def test_prompt_encoder_matches_the_pipeline_and_caches(tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline(transformer=None, vae=None,
        scheduler=FlowMatchEulerDiscreteScheduler(), **tiny_text_components("sd3"))  # fmt: skip
    enc = PromptEncoder(pipe, "sd3", max_sequence_length=8)
    cond = enc(["a red cube", "two dogs", "a red cube"])
    pe, npe, pp, npp = pipe.encode_prompt(["a red cube", "two dogs"], None, None,
        do_classifier_free_guidance=True, negative_prompt="", max_sequence_length=8)  # fmt: skip
    torch.testing.assert_close(cond.embeds["prompt_embeds"][:2], pe)
    torch.testing.assert_close(cond.embeds["pooled_prompt_embeds"][2], pp[0])
    torch.testing.assert_close(cond.negative["prompt_embeds"][0], npe[0])
    torch.testing.assert_close(cond.negative["pooled_prompt_embeds"][0], npp[0])
    assert enc.calls == 1
    enc(["two dogs", "a blue ball"])
    assert enc.calls == 2 and len(enc.cache) == 4  # 3 prompts + the empty negative
    enc(["a blue ball"])
    assert enc.calls == 2
    pol = _sd3(prompt_encoder=enc, guidance_scale=2.0)
    r = pol.sample(["a red cube", "two dogs"], 2, generator=_gen())
    assert r.info["prompt"] == ["a red cube"] * 2 + ["two dogs"] * 2
    assert torch.equal(pol.log_probs(r.actions).logp.detach(), r.old_logp)
    pipe.save_pretrained(tmp_path / "text")  # text encoders and tokenizers of a local folder
    loaded = PromptEncoder.from_pretrained(str(tmp_path / "text"), "sd3", max_sequence_length=8)
    torch.testing.assert_close(loaded(["two dogs"]).embeds["prompt_embeds"][0], pe[1])
    with pytest.raises(ValueError, match="could not load"):
        PromptEncoder.from_pretrained(str(tmp_path / "missing"), "sd3")


def test_errors_name_the_option():
    with pytest.raises(ValueError, match="sampler must be one of"):
        _sd3(sampler="ddim")
    ode = _sd3(sampler="ode").sample(_sd3_cond(), 2, generator=_gen())  # likelihood-free rollouts
    assert not ode.mask.any() and not ode.old_logp.any() and not ode.actions.stochastic.any()
    with pytest.raises(ValueError, match="does not fit family"):
        _sd3(latent_shape=(4, 8))
    with pytest.raises(ValueError, match="train_cfg"):
        _sd3(train_cfg="half")
    with pytest.raises(ValueError, match="target_modules"):
        module_policy(lora={"r": 2, "target_modules": ["nonexistent_proj"]})
    with pytest.raises(ValueError, match="no prompt_encoder"):
        _sd3().sample(["a prompt"], 1)
    with pytest.raises(ValueError, match="mode"):
        _sd3().sample(_sd3_cond(), 1, mode="test")
