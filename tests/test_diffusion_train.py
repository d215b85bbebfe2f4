"""Image policies through train.train(): a user velocity module, a tiny SD3 pipeline (LoRA) and a tiny
SD 1.x pipeline (DDIM) each take full train steps; flow-run resume is bit-identical; every objective
path (Flow-GRPO, GRPO-Guard, KL in the reward, DiffusionNFT, AWM) trains; MixGRPO's window follows
the optimizer step; evaluation draws the same images for the same weights.

Models are tiny (a 2-level conv net at 8x8, diffusers' own test sizes for SD3 / SD 1.x at 8x8) and
built in code; pipelines are saved to a temporary folder and loaded back by the same code a hub id
would take. Nothing is downloaded.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

import grouprl.train as train_mod
from grouprl.config.loading import apply_overrides, validate
from grouprl.demos.velocity import ShapesVelocityNet
from grouprl.envs.tasks import build_task
from grouprl.runtime.checkpoint import CheckpointManager
from grouprl.runtime.throughput import wall_clock
from grouprl.train import train
from grouprl.workloads import build_policy
from grouprl.workloads.images import sampling as images

NET = {"channels": [8, 16], "emb_dim": 16, "groups": 4}


def module_cfg(out_dir, *overrides, name="run"):
    """A user velocity module on the shapes prompts at 8x8: a train step takes well under a second."""
    raw = {
        "run": {"name": name, "output_dir": str(out_dir), "seed": 0, "device": "cpu",
                "console": False},
        "workload": {"type": "images"},
        "model": {"type": "flow", "name_or_path": "grouprl.demos.velocity:ShapesVelocityNet",
                  "module_options": NET, "condition": "class_label", "null_label": 12,
                  "lora": None},
        "task": {"name": "image_prompts", "options": {"source": "shapes", "n_eval": 3}},
        "rollout": {"prompts_per_step": 2, "group_size": 4},
        "algorithm": {"preset": "flow_grpo"},
        "diffusion": {"height": 8, "width": 8, "rollout_steps": 3, "eval_steps": 3,
                      "guidance_scale": 1.0},
        "train": {"steps": 1, "lr": 1e-3},
    }  # fmt: skip
    return validate(apply_overrides(raw, list(overrides)))


def metrics(run_dir, split="train"):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == split]


FULL = "diffusion_pytorch_model.safetensors"


def final_state(run_dir, name="transformer/" + FULL):
    return load_file(CheckpointManager(run_dir).latest() / "model" / name)


def test_user_module_full_train_step(tmp_path):
    # CFG through the null class; one optimizer step per round (the preset takes two): on-policy
    cfg = module_cfg(tmp_path, "diffusion.guidance_scale=2.0", "algorithm.minibatches=1")
    result = train(cfg)
    run = tmp_path / "run"
    (row,) = metrics(run)
    assert row["trained_steps/mean"] == 2.0  # all but the last of 3 steps
    assert row["ratio/step0/mean"] == 1.0 and row["ratio/step1/mean"] == 1.0  # exact on-policy
    assert "ratio/step2/mean" not in row  # the last step is not trained
    assert row["kl"] == 0.0 and row["kl_loss"] == 0.0  # the frozen copy equals the start
    assert all(v == v for v in row.values() if isinstance(v, float))  # no NaN
    assert set(result["after"]) == {"reward", "color_area"}
    assert result["accuracy_key"] == "color_area"
    assert (run / "images" / "step-00000000.png").exists()
    assert (run / "images" / "step-00000001.png").exists()
    torch.manual_seed(0)  # seed_everything(run.seed) runs just before the model is built
    start = ShapesVelocityNet(**NET).state_dict()
    after = final_state(run)
    changed = [k for k in start if not torch.equal(start[k], after[k])]
    assert changed, "one optimizer step must change the weights"


def test_a_task_without_default_reward_needs_rewards_in_the_config(tmp_path):
    cfg = module_cfg(tmp_path, "task.options={source: classes, classes: [cat, dog]}")
    with pytest.raises(ValueError, match="no reward function for the images.*list `rewards`"):
        train(cfg)


# ---- diffusers pipelines built from config ------------------------------------------------------


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    from grouprl.policies.flow.tiny import tiny_sd3_transformer, tiny_text_components, tiny_vae

    path = tmp_path_factory.mktemp("tiny_sd3")
    StableDiffusion3Pipeline(
        transformer=tiny_sd3_transformer(), vae=tiny_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), **tiny_text_components("sd3"),
    ).save_pretrained(path)  # fmt: skip
    return path


@pytest.fixture(scope="module")
def sd1_dir(tmp_path_factory):
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    from grouprl.policies.flow.tiny import tiny_text_components, tiny_unet, tiny_vae

    path = tmp_path_factory.mktemp("tiny_sd1")
    StableDiffusionPipeline(
        unet=tiny_unet(), vae=tiny_vae(sd3_factors=False), scheduler=DDIMScheduler(),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        **tiny_text_components("unet"),
    ).save_pretrained(path)  # fmt: skip
    return path


def pipeline_cfg(out_dir, path, model_type, preset, *overrides):
    model = {"type": model_type, "name_or_path": str(path)}
    if model_type == "flow":
        model["max_sequence_length"] = 8  # T5 tokens: short keeps the test fast
    return module_cfg(
        out_dir, f"model={json.dumps(model)}", f"algorithm.preset={preset}",
        "rewards=[{name: color_area}]", "rollout.group_size=2", "diffusion.rollout_steps=2",
        "diffusion.eval_steps=2", "diffusion.guidance_scale=1.0", *overrides,
    )  # fmt: skip


def test_sd3_pipeline_lora_train_step(tmp_path, sd3_dir):
    """flow_grpo's LoRA (r 32) on the SD3 transformer's attention, mean-space KL to the adapter-off
    reference; the checkpoint holds the diffusers LoRA file."""
    cfg = pipeline_cfg(
        tmp_path,
        sd3_dir,
        "flow",
        "flow_grpo",
        "diffusion.guidance_scale=2.0",
        "algorithm.minibatches=1",
    )  # one update: the logged KL is the first's
    assert cfg.model.lora.r == 32 and cfg.algorithm.kl_coef == 0.04
    train(cfg)
    (row,) = metrics(tmp_path / "run")
    assert row["kl"] == 0.0  # LoRA B starts at 0: the policy is the reference
    assert row["grad_norm"] > 0 and row["ratio/step0/mean"] == 1.0
    lora = final_state(tmp_path / "run", "pytorch_lora_weights.safetensors")
    assert lora and all(k.startswith("transformer.") for k in lora)
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in lora.items())


def test_unet_pipeline_ddpo_train_step(tmp_path, sd1_dir):
    cfg = pipeline_cfg(tmp_path, sd1_dir, "unet", "ddpo", "diffusion.rollout_steps=3")
    assert cfg.diffusion.sampler == "ddim" and cfg.diffusion.eta == 1.0
    train(cfg)
    (row,) = metrics(tmp_path / "run")
    assert row["trained_steps/mean"] == 2.0 and row["grad_norm"] > 0
    assert (CheckpointManager(tmp_path / "run").latest() / "model" / "scheduler").is_dir()


def test_unet_type_needs_the_ddim_sampler(tmp_path, sd1_dir):
    cfg = pipeline_cfg(tmp_path, sd1_dir, "unet", "flow_grpo")
    with pytest.raises(ValueError, match="DDIM sampler is for model.type unet"):
        train(cfg)


# ---- objective paths ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (("diffusion.objective.ratio_norm=grpo_guard", "algorithm.epochs=2"), "guard/ratio_mean"),
        (("algorithm.kl_mode=reward",), "reward/kl_penalty"),
        (("algorithm.preset=diffusion_nft", "diffusion.rollout_steps=4"), "old_weights/decay"),
        (("algorithm.preset=awm", "diffusion.rollout_steps=6", "diffusion.objective.timesteps=2"),
         "fm_mse"),
        (("algorithm.preset=dance_grpo", "diffusion.rollout_steps=4"), "ratio/mean"),
    ],
)  # fmt: skip
def test_objective_paths_train(tmp_path, overrides, expected):
    train(module_cfg(tmp_path, "train.steps=2", *overrides))
    rows = metrics(tmp_path / "run")
    assert len(rows) == 2 and all(expected in r for r in rows)
    assert all(r["loss"] == r["loss"] and r["grad_norm"] > 0 for r in rows)
    if expected == "reward/kl_penalty":  # 0 before the first update, negative after
        assert rows[0]["reward/kl_penalty"] == 0.0 and rows[1]["reward/kl_penalty"] < 0
    if expected == "old_weights/decay":  # DiffusionNFT decay_type 1: min(0.001 step, 0.5)
        assert [r["old_weights/decay"] for r in rows] == [0.001, 0.002]


def test_mixgrpo_window_moves_with_the_optimizer_step(tmp_path):
    cfg = module_cfg(
        tmp_path, "algorithm.preset=mix_grpo", "diffusion.rollout_steps=5",
        "diffusion.train_steps.window_size=2", "diffusion.train_steps.shift_every=2",
    )  # fmt: skip
    policy = build_policy(cfg, torch.device("cpu"))
    task = build_task(cfg.task.name, **cfg.task.options)
    fns = dict(task.reward_fns)
    starts = []
    for opt_step in (0, 1, 2, 4, 100):
        rollout, _ = images.collect(cfg, policy, task.train[:1], fns, optimizer_step=opt_step)
        rows = {tuple(r.nonzero().squeeze(1).tolist()) for r in rollout.mask}
        assert len(rows) == 1  # the same window for every sample
        starts.append(next(iter(rows)))
    # start = shift_by * (step // shift_every), kept inside [0, K - window] ("stay")
    assert starts == [(0, 1), (0, 1), (1, 2), (2, 3), (3, 4)]


def test_evaluation_draws_the_same_images_for_the_same_weights(tmp_path):
    cfg = module_cfg(tmp_path, "task.options.eval_repeats=2")
    policy = build_policy(cfg, torch.device("cpu"))
    task = build_task(cfg.task.name, **cfg.task.options)
    fns = dict(task.reward_fns)
    torch.manual_seed(123)
    m1, rows = images.evaluate(cfg, policy, task.eval, fns, {"color_area": 1.0}, step=0)
    torch.manual_seed(456)  # the global RNG does not matter: the seeds are the examples'
    m2, _ = images.evaluate(cfg, policy, task.eval, fns, {"color_area": 1.0}, step=1)
    assert m1 == m2
    assert [r["seed"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert [r["prompt"] for r in rows][:3] == ["red circle", "red circle", "red square"]
    grid = tmp_path / "run" / "images" / "step-00000000.png"
    from PIL import Image

    assert Image.open(grid).size[1] == 3 * (64 + 2)  # a row per prompt, 8 px tiles shown at 64


# ---- resume ------------------------------------------------------------------------------------

RESUME = ("train.steps=4", "checkpoint.every=2", "eval.every=2")


class Crash(RuntimeError):
    pass


LORA_NFT = ("model.lora={r: 4, alpha: 8, target_modules: [conv1, conv2]}",
            "algorithm.preset=diffusion_nft", "diffusion.rollout_steps=4")  # fmt: skip


FULL_NFT = ("algorithm.preset=diffusion_nft", "diffusion.rollout_steps=4", "model.lora=null")


@pytest.mark.parametrize(
    "variant", [(), LORA_NFT, FULL_NFT], ids=["full_flow_grpo", "lora_nft", "full_nft"]
)
def test_flow_resume_after_crash_is_bit_identical(tmp_path, monkeypatch, variant):
    """Run B crashes in its 3rd update (after step 2's checkpoint) and resumes: weights and every
    metric equal the uninterrupted run A's (LoRA + DiffusionNFT: the old weights are restored too)."""
    train(module_cfg(tmp_path / "a", *RESUME, *variant))
    real, calls = train_mod.update, []

    def crashing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise Crash
        return real(*args, **kwargs)

    monkeypatch.setattr(train_mod, "update", crashing)
    with pytest.raises(Crash):
        train(module_cfg(tmp_path / "b", *RESUME, *variant))
    monkeypatch.setattr(train_mod, "update", real)
    assert CheckpointManager(tmp_path / "b" / "run").latest().name == "step-00000002"
    train(module_cfg(tmp_path / "b", *RESUME, *variant, "run.resume=true"))
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    name = "pytorch_lora_weights.safetensors" if variant == LORA_NFT else "transformer/" + FULL
    wa, wb = final_state(a, name), final_state(b, name)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    strip = lambda rows: [{k: v for k, v in r.items() if not wall_clock(k)} for r in rows]  # noqa: E731
    assert strip(metrics(a)) == strip(metrics(b))
    assert strip(metrics(a, "eval")) == strip(metrics(b, "eval"))
    if variant:  # the last checkpoint holds the NFT old weights (adapter state / old_weights)
        key = "adapter" if variant == LORA_NFT else "old_weights"
        sa, sb = (CheckpointManager.load(CheckpointManager(r).latest())[key] for r in (a, b))
        assert any(k.startswith("old::") for k in sa) and sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


# ---- pieces of the loss side -------------------------------------------------------------------


def test_prepare_clips_advantages_at_adv_clip_max(tmp_path):
    """Group [1, 0, 0, 0]: mean 0.25, unbiased std 0.5, so GRPO gives (0.75, -0.25 x 3) / 0.5001;
    adv_clip_max 1 clips the first to 1.0."""
    from grouprl.types import Rollout
    from grouprl.workloads.images.loss import prepare

    cfg = module_cfg(tmp_path, "algorithm.kl_coef=0", "algorithm.scale=group",
                     "diffusion.adv_clip_max=1.0", "algorithm.minibatches=1")  # fmt: skip
    rollout = Rollout(
        group_ids=torch.tensor([0, 0, 0, 0]), rewards={"color_area": torch.tensor([1.0, 0, 0, 0])},
        actions=None, old_logp=torch.zeros(4, 3), mask=torch.ones(4, 3, dtype=torch.bool),
    )  # fmt: skip
    m = prepare(cfg, None, rollout, {"color_area": 1.0})
    low = -0.25 / (0.5 + 1e-4)
    assert torch.allclose(rollout.advantages, torch.tensor([1.0, low, low, low]))
    assert m["advantage/clipped_frac"] == 0.25 and m["reward/mean"] == 0.25


def test_likelihood_free_mask_marks_the_candidate_timesteps(tmp_path):
    cfg = module_cfg(tmp_path, "algorithm.preset=awm", "diffusion.rollout_steps=10",
                     "diffusion.objective.timesteps=3")  # fmt: skip
    mask = images.lf_mask(cfg, 2, 10)  # sigma indices 1 .. floor(0.9 * 10) = 9 -> steps 0..8
    assert mask.tolist() == [[True] * 9 + [False]] * 2


def test_grpo_guard_loss_is_invariant_to_the_micro_batch_split(tmp_path):
    """The guard term is scaled by each micro-batch's share of the update's trained steps, so
    accumulating 4 micro-batches of 2 gives the full batch's gradient (and the same AdamW step)."""
    guard = ("diffusion.objective.ratio_norm=grpo_guard", "train.max_grad_norm=null")
    train(module_cfg(tmp_path / "full", *guard))
    train(module_cfg(tmp_path / "micro", *guard, "train.micro_batch_size=2"))
    full, micro = final_state(tmp_path / "full" / "run"), final_state(tmp_path / "micro" / "run")
    assert all(torch.allclose(full[k], micro[k], rtol=1e-4, atol=1e-6) for k in full)
    (a,), (b,) = metrics(tmp_path / "full" / "run"), metrics(tmp_path / "micro" / "run")
    # AdamW's first step hides a scale error; the accumulated gradient norm does not
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4) and a["grad_norm"] > 0
