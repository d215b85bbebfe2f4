"""Wan 2.2's pipelines as they come from the hub, on their replicas (grouprl/replicas/diffusion.py):
A14B's two experts (transformer for the high-noise steps, transformer_2 for the low-noise ones,
switched at model_index.json's boundary_ratio as WanPipeline does) and TI2V-5B's 48-channel VAE
with 16x spatial down-sampling and per-token timesteps. FLUX.1 Kontext: tests/test_flow_kontext.py.

Checked here: which expert draws each step (recorded, and the pipeline's own rule on the scheduler's
timesteps); a step's log-prob is the one recomputed with that expert's own forward (and not the
other's), per-expert guidance scales; two training steps through the config path change both
experts' adapters (or only the chosen one's); a full fine-tune saves a folder WanPipeline loads
and generates from, with both experts; a LoRA save loads into both experts with diffusers' own
load_lora_weights.
"""

import json
from dataclasses import replace

import pytest
import torch

from grouprl.config.loading import apply_overrides, validate
from grouprl.policies.flow.experts import DenoiserExperts, lora_file
from grouprl.policies.flow.samplers import flow_sde
from grouprl.replicas.diffusion import (
    build_wan21_t2v,
    build_wan22_t2v_a14b,
    build_wan22_ti2v_5b,
)
from grouprl.workloads.images.policy import build_flow_policy

LORA = {"target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}  # Wan's attn1 / attn2


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan22")
    built = {}

    def get(name):
        if name not in built:
            build = {"a14b": build_wan22_t2v_a14b, "ti2v": build_wan22_ti2v_5b,
                     "wan21": build_wan21_t2v}[name]  # fmt: skip
            built[name] = build(root / name)
        return built[name]

    return get


def _cfg(out, path, *overrides, frames=5, side=16):
    raw = {
        "run": {"name": "run", "output_dir": str(out), "seed": 0, "device": "cpu",
                "console": False},
        "workload": {"type": "images"},
        "model": {"type": "flow", "name_or_path": str(path), "max_sequence_length": 8,
                  "lora": LORA},
        "task": {"name": "image_prompts", "options": {"source": "shapes", "n_eval": 2}},
        "rewards": [{"name": "color_area"}],
        "rollout": {"prompts_per_step": 1, "group_size": 2},
        "algorithm": {"preset": "flow_grpo"},
        "diffusion": {"height": side, "width": side, "rollout_steps": 6, "eval_steps": 3,
                      "guidance_scale": 1.0, "num_frames": frames},
        "train": {"steps": 1, "lr": 1e-3},
    }  # fmt: skip
    return validate(apply_overrides(raw, list(overrides)))


def _policy(tmp_path, path, *overrides, **kw):
    return build_flow_policy(_cfg(tmp_path, path, *overrides, **kw), "cpu")


def _pipeline_experts(folder, k):
    """WanPipeline's rule on its own scheduler: 0 (transformer) where t >= boundary, else 1."""
    from diffusers import UniPCMultistepScheduler

    index = json.loads((folder / "model_index.json").read_text())
    sched = UniPCMultistepScheduler.from_pretrained(folder, subfolder="scheduler")
    sched.set_timesteps(k)
    boundary = index["boundary_ratio"] * sched.config.num_train_timesteps
    return torch.tensor([0 if t >= boundary else 1 for t in sched.timesteps])  # [K]


# ---- sampling and scoring with two experts -----------------------------------------------------


@torch.no_grad()
def _velocity(net, x, timestep, cond, scale):
    """The guided velocity [B, ...] as WanPipeline computes it: two calls, uncond + s (text - uncond)."""

    def call(emb):
        return net(hidden_states=x, timestep=timestep, encoder_hidden_states=emb,
                   return_dict=False)[0].float()  # fmt: skip

    text = call(cond.embeds["prompt_embeds"])
    if scale == 1.0:
        return text
    uncond = call(cond.negative["prompt_embeds"])
    return uncond + scale * (text - uncond)


def test_a14b_samples_each_step_with_the_pipelines_expert(tmp_path, folders):
    """Old code: only `transformer` loaded, so every low-noise step came from the high-noise
    expert (the recomputation below with transformer_2 then differs from the stored log-prob)."""
    folder = folders("a14b")
    pol = _policy(tmp_path, folder, "diffusion.guidance_scale_2=3.0")
    r = pol.sample(["a red square"], 2, generator=torch.Generator().manual_seed(0))
    batch, k_steps = r.actions, r.mask.shape[1]
    want = _pipeline_experts(folder, k_steps)  # [K]
    assert 0 < int(want.sum()) < k_steps  # both experts take part at 6 steps
    assert torch.equal(batch.expert, want.expand(2, -1))  # recorded per step
    # per-expert guidance as WanPipeline: guidance_scale (high), guidance_scale_2 (low)
    assert batch.guidance_scale.tolist() == [[1.0, 3.0], [1.0, 3.0]]

    # each trained step's log-prob, recomputed with the expert's own diffusers forward
    nets = {0: pol.model.expert(0), 1: pol.model.expert(1)}
    cond = batch.cond
    for k in range(k_steps):
        if not bool(r.mask[:, k].any()):
            continue
        x, sigma, nxt = batch.latents[:, k], batch.sigmas[:, k], batch.sigmas[:, k + 1]

        own = int(want[k])
        scale = [1.0, 3.0][own]
        v = {e: _velocity(nets[e], x, batch.timesteps[:, k], cond, scale) for e in (0, 1)}
        nxt_x = batch.latents[:, k + 1]
        lp = {e: flow_sde(x, v[e], sigma, nxt, noise_level=0.7, prev_sample=nxt_x).log_prob
              for e in (0, 1)}  # fmt: skip
        torch.testing.assert_close(lp[own], r.old_logp[:, k], rtol=1e-5, atol=1e-5)
        assert (lp[1 - own] - r.old_logp[:, k]).abs().min() > 1e-3  # the other expert differs

    # re-scoring uses the recorded expert: ratio 1; forcing the other expert changes it
    out = pol.log_probs(batch)
    assert torch.equal(out.logp[r.mask], r.old_logp[r.mask])
    flipped = pol.log_probs(replace(batch, expert=1 - batch.expert))
    assert (flipped.logp[r.mask] - r.old_logp[r.mask]).abs().min() > 1e-3


def test_a14b_scores_mixed_expert_rows(tmp_path, folders):
    """Rows at different noise levels in one call (DiffusionNFT's forward noising draws a time per
    row) each get their own expert; a one-row negative is shared."""
    pol = _policy(tmp_path, folders("a14b"))
    cond = pol.encode(["a red square", "a blue circle"])
    x0 = torch.randn(2, *pol.latent_shape, generator=torch.Generator().manual_seed(1))
    noise = torch.randn_like(x0)
    t = torch.tensor([0.95, 0.3])  # high-noise row, low-noise row
    both = pol.forward_noising(x0, t, noise, cond)
    for i in range(2):
        one = pol.forward_noising(x0[i : i + 1], t[i : i + 1], noise[i : i + 1],
                                  type(cond)({k: v[i : i + 1] for k, v in cond.embeds.items()},
                                             cond.negative))  # fmt: skip
        torch.testing.assert_close(both[i : i + 1], one, rtol=1e-5, atol=1e-6)
    assert pol.model.expert_index(t).tolist() == [0, 1]


# ---- training through the config path ----------------------------------------------------------


def _lora_files(run_dir):
    from safetensors.torch import load_file

    from grouprl.runtime.checkpoint import CheckpointManager

    model = CheckpointManager(run_dir).latest() / "model"
    return {n: load_file(model / lora_file(n)) if (model / lora_file(n)).is_file() else None
            for n in ("transformer", "transformer_2")}  # fmt: skip


@pytest.mark.parametrize(("experts", "trained"), [("both", {"transformer", "transformer_2"}),
                                                   ("low_noise", {"transformer_2"})])  # fmt: skip
def test_a14b_two_training_steps_train_the_chosen_experts(tmp_path, folders, experts, trained):
    from grouprl.train import train

    cfg = _cfg(tmp_path, folders("a14b"), f"model.experts={experts}", "train.steps=2",
               "diffusion.rollout_steps=4", "algorithm.kl_coef=0.0")  # fmt: skip
    train(cfg)
    files = _lora_files(tmp_path / "run")
    assert {n for n, f in files.items() if f is not None} == trained
    for name in trained:  # LoRA B starts at 0: a nonzero B is a trained expert
        assert all(k.startswith("transformer.") for k in files[name])
        assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0
                   for k, v in files[name].items())  # fmt: skip


def test_frozen_expert_has_no_adapter_and_no_gradient(tmp_path, folders):
    pol = _policy(tmp_path, folders("a14b"), "model.experts=high_noise")
    names = [n for n, _ in pol.model.named_parameters()]
    assert any(n.startswith("experts.transformer.") and ".lora_" in n for n in names)
    assert not any(n.startswith("experts.transformer_2.") and ".lora_" in n for n in names)
    assert all(n.startswith("experts.transformer.") for n in pol.weights.trainable())


def test_a14b_full_fine_tune_saves_a_two_expert_pipeline(tmp_path, folders):
    """Old code: only transformer/ was written and transformer_2 copied unchanged."""
    import diffusers

    pol = _policy(tmp_path, folders("a14b"), "model.lora=null")
    with torch.no_grad():  # a stand-in for training: move both experts' weights
        for p in pol.trainable_parameters():
            p.add_(0.01)
    out = pol.save_pretrained(tmp_path / "saved")
    pipe = diffusers.DiffusionPipeline.from_pretrained(out)
    assert type(pipe).__name__ == "WanPipeline" and pipe.config.boundary_ratio == 0.875
    for name in ("transformer", "transformer_2"):
        ours = pol.model.experts[name].state_dict()
        for k, v in getattr(pipe, name).state_dict().items():
            torch.testing.assert_close(v, ours[k].to(v.dtype))
    video = pipe(prompt="a red square", height=16, width=16, num_frames=5, num_inference_steps=4,
                 guidance_scale=1.0, max_sequence_length=8, output_type="pt",
                 generator=torch.Generator().manual_seed(0)).frames  # fmt: skip
    assert video.shape == (1, 5, 3, 16, 16) and torch.isfinite(video).all()


def test_a14b_lora_save_loads_into_both_experts_with_diffusers(tmp_path, folders):
    import diffusers

    folder = folders("a14b")
    pol = _policy(tmp_path, folder)
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.normal_(0, 0.02)
    pol.save_pretrained(tmp_path / "lora")
    pipe = diffusers.WanPipeline.from_pretrained(folder)
    pipe.load_lora_weights(tmp_path / "lora")
    pipe.load_lora_weights(tmp_path / "lora", weight_name=lora_file("transformer_2"),
                           load_into_transformer_2=True, adapter_name="low")  # fmt: skip
    x = torch.randn(1, *pol.latent_shape)
    emb = pol.encode(["a red square"]).embeds["prompt_embeds"]
    t = torch.tensor([500.0])
    for name in ("transformer", "transformer_2"):
        with torch.no_grad():
            ref = pol.model.experts[name](hidden_states=x, timestep=t, encoder_hidden_states=emb,
                                          return_dict=False)[0]  # fmt: skip
            got = getattr(pipe, name)(hidden_states=x, timestep=t, encoder_hidden_states=emb,
                                      return_dict=False)[0]  # fmt: skip
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    reloaded = _policy(tmp_path, folder)
    reloaded.load_saved_weights(tmp_path / "lora")
    for a, b in zip(reloaded.trainable_parameters(), pol.trainable_parameters(), strict=True):
        assert torch.equal(a, b)


# ---- options that cannot apply, and refusals ----------------------------------------------------


def test_expert_options_on_a_one_denoiser_pipeline_are_errors(tmp_path, folders):
    with pytest.raises(ValueError, match="model.experts='high_noise'"):
        _policy(tmp_path, folders("wan21"), "model.experts=high_noise")
    with pytest.raises(ValueError, match="diffusion.guidance_scale_2"):
        _policy(tmp_path, folders("wan21"), "diffusion.guidance_scale_2=3.0")


def test_two_experts_without_boundary_ratio_is_refused(tmp_path, folders):
    import shutil

    folder = tmp_path / "no_boundary"
    shutil.copytree(folders("a14b"), folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["boundary_ratio"] = None
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="boundary_ratio"):
        _policy(tmp_path, folder)


# ---- Wan 2.2 TI2V-5B ------------------------------------------------------------------------------


def test_ti2v_latents_and_timesteps_follow_the_pipeline(tmp_path, folders):
    """Old code: the VAE's 16x spatial factor was taken as 8x (from its 3 down-sampling levels),
    so the latents were twice the pipeline's size, and the timestep went in as one per sample."""
    import diffusers

    folder = folders("ti2v")
    pol = _policy(tmp_path, folder, frames=5, side=32)
    pipe = diffusers.WanPipeline.from_pretrained(folder)
    want = pipe.prepare_latents(1, 48, 32, 32, 5, torch.float32, "cpu", None).shape[1:]
    assert pol.latent_shape == tuple(want) == (48, 2, 2, 2)
    assert pol.family.name == "wan_expand" and not isinstance(pol.model, DenoiserExperts)
    # one step's prediction equals the transformer called as WanPipeline calls it
    x = torch.randn(1, *pol.latent_shape, generator=torch.Generator().manual_seed(0))
    cond = pol.encode(["a red square"])
    cols = pol.schedule_columns(4, 1)
    got = pol.predict(pol.model, x, cols, 1, cond, torch.ones(1))
    t = cols["timesteps"][:, 1]
    mask = torch.ones_like(x)
    per_token = (mask[0][0][:, ::2, ::2] * t).flatten()[None]  # WanPipeline's expand_timesteps
    with torch.no_grad():
        ref = pol.model(
            hidden_states=x,
            timestep=per_token,
            encoder_hidden_states=cond.embeds["prompt_embeds"],
            return_dict=False,
        )[0]
    torch.testing.assert_close(got, ref.float())
    r = pol.sample(cond, 2, generator=torch.Generator().manual_seed(0))
    assert torch.equal(pol.log_probs(r.actions).logp[r.mask], r.old_logp[r.mask])
    video = pol.decode(r.actions.final)
    assert video.shape == (2, 3, 5, 32, 32) and torch.isfinite(video).all()


def test_gradient_checkpointing_reaches_both_experts(tmp_path, folders):
    pol = _policy(tmp_path, folders("a14b"), "model.gradient_checkpointing=true")
    assert all(net.is_gradient_checkpointing for net in pol.model.experts.values())


def test_scoring_one_experts_steps_still_gives_every_trained_weight_a_gradient(tmp_path, folders):
    """DDP needs a gradient for every trainable parameter: scoring only high-noise steps (a step
    window) gives the low-noise expert's adapter zeros, not None."""
    pol = _policy(tmp_path, folders("a14b"))
    r = pol.sample(["a red square"], 2, generator=torch.Generator().manual_seed(0))
    high = [k for k in range(r.mask.shape[1]) if int(r.actions.expert[0, k]) == 0]
    pol.log_probs(r.actions, steps=high).logp.sum().backward()
    grads = {n: p.grad for n, p in pol.weights.trainable().items()}
    assert all(g is not None for g in grads.values())
    low = [g for n, g in grads.items() if n.startswith("experts.transformer_2.")]
    assert low and all(bool((g == 0).all()) for g in low)
    assert any(bool(g.abs().sum() > 0) for n, g in grads.items()
               if n.startswith("experts.transformer."))  # fmt: skip
