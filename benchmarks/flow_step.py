"""Flow step: time per image of a rollout plus one training step, grouprl's FlowPolicy vs a plain loop.

Model: the tiny random SD3 transformer of grouprl.policies.flow.tiny (one block, latents
4 x 32 x 32), conditioned on fixed random text embeddings (no text encoder, no VAE: the sampler
and scoring code path is what is measured). Workload per iteration: `--prompts` prompts x
`--group` images, `--steps` Flow-GRPO SDE steps (noise level 0.7, all steps stochastic, all but
the last trained), then one AdamW step on loss = -mean over trained steps of advantage x log-prob.

- grouprl:   FlowPolicy.sample (rollout) -> FlowPolicy.log_probs (re-scoring, autograd) -> step.
- reference: the same per-step loop written plainly in this file: a python loop over the steps
             calling the transformer, the Flow-GRPO SDE mean / std and the Gaussian log-prob
             written out, then a second loop re-scoring the trained steps with autograd.
Both use the same sigmas, model weights, conditioning and advantages; the runs alternate
grouprl, reference, grouprl ... in one process (`--reps` each, after one warm-up of each), and
the table reports the median seconds per image of each phase. The first iteration's log-probs
of both are also compared (same noise draws are not shared, so only the re-scored chain is
compared: the reference re-scores grouprl's own trajectory).

    .venv/bin/python benchmarks/flow_step.py [--prompts 2 --group 4 --steps 10 --reps 3]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

LATENT = (4, 32, 32)
NOISE_LEVEL = 0.7


def plain_step_stats(x, v, s, sn):
    """Flow-GRPO SDE step written out: mean and std of x_{k+1} given x_k, velocity v."""
    g = NOISE_LEVEL * math.sqrt(s / (1 - (sn if s == 1 else s)))
    d = sn - s
    mean = x * (1 + g * g * d / (2 * s)) + v * (1 + g * g * (1 - s) / (2 * s)) * d
    return mean, g * math.sqrt(-d)


def plain_logp(sample, mean, std: float):
    """Mean over latent elements of log N(sample; mean, std^2): [n]."""
    lp = -((sample - mean) ** 2) / (2 * std * std) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return lp.flatten(1).mean(1)


def plain_iteration(model, emb, pooled, sigmas, timesteps, adv, opt) -> dict[str, float]:
    import torch

    n, K = emb.shape[0], len(sigmas) - 1
    t0 = time.perf_counter()
    xs = [torch.randn(n, *LATENT)]
    with torch.no_grad():
        for k in range(K):
            v = model(hidden_states=xs[k], timestep=timesteps[k].expand(n),
                      encoder_hidden_states=emb, pooled_projections=pooled,
                      return_dict=False)[0].float()  # fmt: skip
            mean, std = plain_step_stats(xs[k], v, float(sigmas[k]), float(sigmas[k + 1]))
            xs.append(mean + std * torch.randn_like(mean))
    t1 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = rescore_plain(model, emb, pooled, sigmas, timesteps, torch.stack(xs, 1), adv)
    loss.backward()
    opt.step()
    return {"rollout_s": t1 - t0, "train_s": time.perf_counter() - t1}


def rescore_plain(model, emb, pooled, sigmas, timesteps, latents, adv):
    """-mean over the K-1 trained steps of adv * logp, re-scored with autograd: a scalar."""
    n, K = emb.shape[0], len(sigmas) - 1
    total = 0.0
    for k in range(K - 1):
        v = model(hidden_states=latents[:, k], timestep=timesteps[k].expand(n),
                  encoder_hidden_states=emb, pooled_projections=pooled,
                  return_dict=False)[0].float()  # fmt: skip
        mean, std = plain_step_stats(latents[:, k], v, float(sigmas[k]), float(sigmas[k + 1]))
        total = total + (adv * plain_logp(latents[:, k + 1], mean, std)).mean()
    return -total / (K - 1)


def grouprl_iteration(policy, cond, group, steps, adv, opt) -> tuple[dict[str, float], Any]:
    t0 = time.perf_counter()
    rollout = policy.sample(cond, group, steps=steps)
    t1 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    policy.train()
    out = policy.log_probs(rollout.actions)
    mask = rollout.mask.float()  # [n, K]
    loss = -((out.logp * adv[:, None] * mask).sum(1) / mask.sum(1)).mean()
    loss.backward()
    opt.step()
    return {"rollout_s": t1 - t0, "train_s": time.perf_counter() - t1}, rollout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="denoising steps")
    p.add_argument("--reps", type=int, default=3, help="timed iterations per side")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=C.RESULTS)
    a = p.parse_args(argv)
    import copy

    import torch

    from grouprl.policies.flow.policy import FlowPolicy
    from grouprl.policies.flow.tiny import tiny_sd3_transformer
    from grouprl.policies.flow.types import FlowCondition

    C.worker_setup(a.threads)
    info = C.machine_info(a.threads)
    print(f"machine: {C.describe_machine(info)}")
    torch.manual_seed(0)
    base = tiny_sd3_transformer(seed=0, sample_size=LATENT[-1])
    emb = torch.randn(a.prompts, 8, 32)  # [B, L, D] prompt embeddings
    pooled = torch.randn(a.prompts, 64)  # [B, P]
    n = a.prompts * a.group
    adv = torch.linspace(-1, 1, n)  # [n] fixed advantages
    policy = FlowPolicy(copy.deepcopy(base), latent_shape=LATENT, noise_level=NOISE_LEVEL,
                        rollout_steps=a.steps)  # fmt: skip
    cond = FlowCondition({"prompt_embeds": emb, "pooled_prompt_embeds": pooled})
    g_opt = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-5)
    sched = policy.rules.set_timesteps(a.steps)
    sigmas, timesteps = sched["sigmas"], sched["timesteps"]  # [K+1] each
    ref_model = copy.deepcopy(base).train()
    r_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-5)
    emb_n, pooled_n = emb.repeat_interleave(a.group, 0), pooled.repeat_interleave(a.group, 0)

    # agreement: the plain re-scoring of grouprl's first trajectory vs FlowPolicy.log_probs
    rollout = policy.sample(cond, a.group, steps=a.steps)
    with torch.no_grad():
        g_lp = policy.log_probs(rollout.actions).logp[:, : a.steps - 1]  # [n, K-1]
        lat = rollout.actions.latents
        p_lp = torch.stack([
            plain_logp(lat[:, k + 1], *plain_step_stats(
                lat[:, k], base(hidden_states=lat[:, k], timestep=timesteps[k].expand(n),
                                encoder_hidden_states=emb_n, pooled_projections=pooled_n,
                                return_dict=False)[0].float(),
                float(sigmas[k]), float(sigmas[k + 1])))
            for k in range(a.steps - 1)], 1)  # fmt: skip
    agree = float((g_lp - p_lp).abs().max())
    times: dict[str, list[dict[str, float]]] = {"grouprl": [], "reference": []}
    for rep in range(a.reps + 1):  # the first of each side is the warm-up
        g, _ = grouprl_iteration(policy, cond, a.group, a.steps, adv, g_opt)
        r = plain_iteration(ref_model, emb_n, pooled_n, sigmas, timesteps, adv, r_opt)
        if rep:
            times["grouprl"].append(g)
            times["reference"].append(r)
    summary = {}
    for side, ts in times.items():
        summary[side] = {k: C.median([t[k] for t in ts]) / n for k in ("rollout_s", "train_s")}
        summary[side]["total_s"] = C.median([t["rollout_s"] + t["train_s"] for t in ts]) / n
    ratio = summary["grouprl"]["total_s"] / summary["reference"]["total_s"]
    rows = [[side, f"{1e3 * s['rollout_s']:.1f}", f"{1e3 * s['train_s']:.1f}",
             f"{1e3 * s['total_s']:.1f}"] for side, s in summary.items()]  # fmt: skip
    rows.append(["grouprl/reference", "", "", f"{ratio:.2f}x"])
    print()
    print(f"tiny SD3 transformer, {n} images ({a.prompts} prompts x {a.group}), {a.steps} SDE "
          f"steps, latents {LATENT}; ms per image (median of {a.reps})")  # fmt: skip
    print(C.format_table(["side", "rollout ms/image", "train step ms/image", "total ms/image"],
                         rows))  # fmt: skip
    print(f"agreement: max |logp(grouprl) - logp(plain)| on the same trajectory = {agree:.2e}")
    warn = C.warn_if_loaded(info)
    if warn:
        print(warn)
    results = {"machine": info, "settings": vars(a) | {"out": str(a.out)}, "times": times,
               "summary": summary, "ratio": ratio, "logp_agreement": agree}  # fmt: skip
    C.write_json(a.out / "flow_step.json", results)
    panels = [("ms per image", {side: [1e3 * s["rollout_s"], 1e3 * s["train_s"], 1e3 * s["total_s"]]
                                for side, s in summary.items()}, ["rollout", "train", "total"])]  # fmt: skip
    C.bar_png(a.out / "flow_step.png", panels, "flow step: grouprl FlowPolicy vs a plain loop")
    print(f"wrote {a.out / 'flow_step.json'} and {a.out / 'flow_step.png'}")
    print(f"time_per_image_ratio grouprl/reference: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
