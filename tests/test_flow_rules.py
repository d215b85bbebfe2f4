"""The step rules a FlowPolicy is composed with (policies/flow/rules.py): one-step values of each
rule against formulas written here, their schedules, and a user-written rules object used by
FlowPolicy."""

import math

import pytest
import torch

from grouprl.policies.flow.policy import FlowPolicy
from grouprl.policies.flow.rules import DDPO_SCHEDULER, DDIMRules, FlowMatchRules
from grouprl.policies.flow.samplers import StepOutput
from grouprl.policies.flow.text_encoders import class_condition
from grouprl.policies.flow.types import FlowBatch, FlowCondition

X = torch.tensor([[0.5, -1.0, 2.0]])  # [B=1, 3]
V = torch.tensor([[1.0, 0.25, -0.5]])  # [B=1, 3]


def _cols(sigmas):
    return {"sigmas": torch.tensor([sigmas])}  # [1, K+1]


def test_flow_sde_step_mean_and_std_by_hand():
    rules = FlowMatchRules({}, "flow_sde", 0.7)
    s, sn, a = 0.6, 0.4, 0.7
    g = a * math.sqrt(s / (1 - s))
    d = sn - s
    mean = X * (1 + g**2 * d / (2 * s)) + V * (1 + g**2 * (1 - s) / (2 * s)) * d
    out = rules.step(_cols([s, sn]), 0, X, V, torch.tensor([True]), generator=torch.Generator())
    torch.testing.assert_close(out.mean, mean)
    torch.testing.assert_close(out.std, torch.tensor([g * math.sqrt(-d)]))
    # a deterministic row takes the Euler step x + (sigma_next - sigma) v, std 0, log-prob 0
    det = rules.step(_cols([s, sn]), 0, X, V, torch.tensor([False]))
    torch.testing.assert_close(det.mean, X + d * V)
    assert float(det.std) == 0.0 and float(det.log_prob) == 0.0


def test_dance_sde_and_cps_steps_by_hand():
    s, sn, eta = 0.6, 0.4, 0.3
    out = FlowMatchRules({}, "dance_sde", eta).step(_cols([s, sn]), 0, X, V, torch.tensor([True]))
    x0 = X - s * V
    score = -(X - (1 - s) * x0) / s**2
    torch.testing.assert_close(out.mean, X + (sn - s) * V - (sn - s) * eta**2 * score / 2)
    torch.testing.assert_close(out.std, torch.tensor([eta * math.sqrt(s - sn)]))
    a = 0.5
    out = FlowMatchRules({}, "cps", a).step(_cols([s, sn]), 0, X, V, torch.tensor([True]))
    std = sn * math.sin(a * math.pi / 2)
    eps = X + (1 - s) * V
    torch.testing.assert_close(out.mean, (1 - sn) * x0 + math.sqrt(sn**2 - std**2) * eps)
    torch.testing.assert_close(out.std, torch.tensor([std]))


def test_scoring_uses_the_given_noise_level_and_prev_sample():
    rules = FlowMatchRules({}, "flow_sde", 0.7)
    cols, rows = _cols([0.6, 0.4]), torch.tensor([True])
    drawn = rules.step(cols, 0, X, V, rows, generator=torch.Generator().manual_seed(0))
    again = rules.step(cols, 0, X, V, rows, prev_sample=drawn.prev_sample)
    torch.testing.assert_close(again.log_prob, drawn.log_prob, rtol=0, atol=0)
    other = rules.step(cols, 0, X, V, rows, noise_level=0.35, prev_sample=drawn.prev_sample)
    torch.testing.assert_close(other.std, drawn.std / 2)


def test_flow_match_linear_schedule_and_kl_variances():
    cols = FlowMatchRules({"shift": 1.0}, sigma_spacing="linear").set_timesteps(4)
    torch.testing.assert_close(cols["sigmas"], torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    torch.testing.assert_close(cols["timesteps"], torch.tensor([1000.0, 750, 500, 250, 0]))
    assert cols["alphas"] is None
    batch = FlowBatch(
        latents=torch.zeros(1, 3, 2), sigmas=torch.tensor([[1.0, 0.75, 0.25]]),
        timesteps=torch.zeros(1, 3), cond=FlowCondition({"y": torch.zeros(1)}),
        guidance_scale=torch.ones(1), train_mask=torch.ones(1, 2, dtype=torch.bool),
        stochastic=torch.ones(1, 2, dtype=torch.bool),
    )  # fmt: skip
    std = torch.tensor([[0.2, 0.4]])  # [n, K]
    flow_grpo = FlowMatchRules({}).kl_var(batch, std)
    torch.testing.assert_close(flow_grpo, torch.tensor([[0.04 / 0.25, 0.16 / 0.5]]))
    torch.testing.assert_close(FlowMatchRules({}, kl_form="exact").kl_var(batch, std), std**2)
    torch.testing.assert_close(DDIMRules().kl_var(batch, std), std**2)


def test_ddim_step_by_hand():
    a_t, a_p, eta = 0.5, 0.8, 1.0
    cols = {"alphas": torch.tensor([[a_t, a_p]])}
    out = DDIMRules(noise_level=eta).step(cols, 0, X, V, torch.tensor([True]))
    var = (1 - a_p) / (1 - a_t) * (1 - a_t / a_p)  # 0.15
    x0 = (X - math.sqrt(1 - a_t) * V) / math.sqrt(a_t)
    mean = math.sqrt(a_p) * x0 + math.sqrt(1 - a_p - eta**2 * var) * V
    torch.testing.assert_close(out.mean, mean)
    torch.testing.assert_close(out.std, torch.tensor([eta * math.sqrt(var)]))
    det = DDIMRules(noise_level=eta).step(cols, 0, X, V, torch.tensor([False]))
    torch.testing.assert_close(det.mean, math.sqrt(a_p) * x0 + math.sqrt(1 - a_p) * V)


def test_ddim_schedule_by_hand():
    """SD 1.x betas (scaled_linear), leading spacing with steps_offset 1: t = 751, 501, 251, 1; the
    last slot (t = 1 - 250 < 0) takes alpha_bar(0), as set_alpha_to_one is False."""
    cols = DDIMRules(DDPO_SCHEDULER).set_timesteps(4)
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2
    ac = torch.cumprod(1 - betas, 0)
    want = torch.stack([ac[751], ac[501], ac[251], ac[1], ac[0]]).float()
    torch.testing.assert_close(cols["alphas"], want)
    torch.testing.assert_close(cols["sigmas"], (1 - want).sqrt())
    torch.testing.assert_close(cols["timesteps"], torch.tensor([751.0, 501, 251, 1, 0]))


class Velocity(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x, sigma, class_labels):
        return self.w * x  # [B, C, H, W]


class HalvingRules:
    """A user-written rules object: two fixed slots per step, x_{k+1} = x - pred / 2 + 0.1 z on
    stochastic rows (std 0.1), counting its calls."""

    sampler, noise_level, prediction = "halving", 0.1, "velocity"
    scheduler_config: dict = {}

    def __init__(self):
        self.calls = {"set_timesteps": 0, "step": 0}

    def set_timesteps(self, num_steps):
        self.calls["set_timesteps"] += 1
        sigmas = torch.linspace(1.0, 0.0, num_steps + 1)  # [K+1]
        return {"sigmas": sigmas, "timesteps": sigmas * 10, "alphas": None}

    def step(self, cols, k, x, pred, stochastic, *, noise_level=None, prev_sample=None,
             generator=None):  # fmt: skip
        from grouprl.policies.flow.samplers import gaussian_log_prob

        self.calls["step"] += 1
        mean = x.float() - pred.float() / 2
        std = torch.where(stochastic, 0.1, 0.0)  # [B]
        if prev_sample is None:
            z = torch.randn(x.shape, generator=generator)
            prev_sample = mean + std.reshape(-1, *[1] * (x.dim() - 1)) * z
        return StepOutput(prev_sample, gaussian_log_prob(prev_sample, mean, std), mean, std)

    def kl_var(self, batch, std):
        return std**2

    def save_scheduler(self, directory, from_pipeline):
        return set()


def test_a_user_rules_object_drives_sampling_and_scoring():
    rules = HalvingRules()
    pol = FlowPolicy(Velocity(), latent_shape=(1, 2, 2), family="module", rules=rules,
                     rollout_steps=3)  # fmt: skip
    assert pol.rules is rules
    gen = torch.Generator().manual_seed(0)
    r = pol.sample(class_condition([0]), 2, generator=gen, store_means=True)
    b = r.actions
    assert b.sampler == "halving" and b.noise_level == 0.1
    assert rules.calls == {"set_timesteps": 1, "step": 3}
    torch.testing.assert_close(b.sigmas[0], torch.tensor([1.0, 2 / 3, 1 / 3, 0.0]))
    # every step's mean is the user's rule: x_k - v / 2 with v = 0.5 x_k; the draw adds 0.1 z
    torch.testing.assert_close(b.old_mean, 0.75 * b.latents[:, :3])
    assert bool(b.stochastic.all()) and not torch.allclose(b.latents[:, 1:], b.old_mean)
    out = pol.log_probs(b)
    torch.testing.assert_close(out.logp, r.old_logp, rtol=0, atol=0)
    assert bool((out.logp[b.train_mask] != 0).all())
    ev = pol.sample(class_condition([0]), 1, mode="eval", generator=gen).actions
    torch.testing.assert_close(ev.latents[:, 1:], 0.75 * ev.latents[:, :-1])


def test_rules_and_default_rules_keywords_do_not_mix():
    with pytest.raises(ValueError, match=r"\['noise_level', 'sampler'\] build the default rules"):
        FlowPolicy(Velocity(), latent_shape=(1, 2, 2), family="module", rules=HalvingRules(),
                   sampler="cps", noise_level=0.5)  # fmt: skip
    with pytest.raises(ValueError, match="a UNet predicts epsilon and takes DDIMRules"):
        FlowPolicy(Velocity(), latent_shape=(1, 2, 2), family="module", rules=DDIMRules())
    with pytest.raises(ValueError, match="sampler must be one of"):
        FlowMatchRules({}, "ddim")


def test_diffusion_sigma_spacing_reaches_the_rules(tmp_path):
    """diffusion.sigma_spacing set in the config is the schedule's (it used to be written onto the
    family after the policy had fixed its spacing, and was ignored); model.type unet refuses it."""
    from test_diffusion_train import module_cfg

    from grouprl.workloads.images.policy import build_flow_policy

    cpu = torch.device("cpu")
    pol = build_flow_policy(module_cfg(tmp_path, "diffusion.sigma_spacing=linear"), cpu)
    torch.testing.assert_close(
        pol.rules.set_timesteps(4)["sigmas"], torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    )
    default = build_flow_policy(module_cfg(tmp_path), cpu).rules.set_timesteps(4)["sigmas"]
    assert not torch.allclose(default, torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    unet = module_cfg(tmp_path, "model.type=unet", "diffusion.sampler=ddim",
                      "diffusion.sigma_spacing=linear")  # fmt: skip
    with pytest.raises(ValueError, match="remove diffusion.sigma_spacing"):
        build_flow_policy(unet, cpu)


def test_collect_and_prepare_fill_typed_fields_not_info(tmp_path):
    """The examples and the reference means the loss reads travel in Rollout.examples and
    FlowBatch.ref_mean; the loss reads no `info` entry (info is for logs)."""
    from test_diffusion_train import module_cfg

    from grouprl.envs.tasks import build_task
    from grouprl.objectives.objective import count_tokens
    from grouprl.workloads.images import loss as image_loss
    from grouprl.workloads.images import sampling as images
    from grouprl.workloads.images.policy import build_flow_policy

    cfg = module_cfg(tmp_path, "algorithm.kl_coef=0.1", "algorithm.minibatches=1")
    policy = build_flow_policy(cfg, torch.device("cpu"))
    task = build_task(cfg.task.name, **cfg.task.options)
    rollout, _ = images.collect(cfg, policy, task.train[:2], dict(task.reward_fns))
    assert rollout.examples == [ex for ex in task.train[:2] for _ in range(4)]
    image_loss.prepare(cfg, policy, rollout, {"color_area": 1.0})
    with policy.reference() as ref:
        want = ref.log_probs(rollout.actions).extras["mean"]  # [N, K, *latent]
    torch.testing.assert_close(rollout.actions.ref_mean, want, rtol=0, atol=0)
    assert "ref_mean" not in rollout.info
    rollout.info.clear()  # nothing the loss needs lives there
    sub = rollout.select(torch.arange(4))
    assert sub.actions.ref_mean.shape[0] == 4
    res, _ = image_loss.micro_loss(cfg, policy, sub, count_tokens(rollout.mask), True)
    assert res.metrics["kl"] >= 0.0 and torch.isfinite(res.loss)
