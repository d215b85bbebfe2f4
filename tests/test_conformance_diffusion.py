"""Conformance of every shipped diffusion config (configs/diffusion/*.yaml) on its model's replica.

Each config runs 2 training steps through the command users type (`grouprl train CONFIG ...`, here
`grouprl.cli.main` in-process) in the config's OWN dtype; the overrides change only sizes (the model
path to the replica, 1 prompt x 2 samples, 2 denoising steps, a tiny resolution, a short T5 length,
one held-out prompt) and point the CLIP / PickScore rewards at their local replicas. Then:

- both updates ran on finite losses and gradients, and every tensor the checkpoint holds (the
  diffusers files and the trainer state) is finite;
- the trained weights and the optimizer state are float32 whatever the compute dtype (master
  weights, ARCHITECTURE rule 9);
- the checkpoint loads where users load it (diffusers `DiffusionPipeline.from_pretrained` of the
  replica + `pipe.load_lora_weights(checkpoint)`; a user velocity module's `from_pretrained`) and
  that denoiser gives grouprl's trained policy's output for the same inputs (within the dtype's
  rounding); the loaded pipeline runs a 2-step call to finite images;
- a new run starts from it (a pipeline folder with the LoRA fused by diffusers, or the module's
  weights folder);
- a full fine-tune (no LoRA) saves a complete pipeline folder that diffusers loads;
- a rollout steps through the sigmas the replica's own pipeline uses (shift, Wan's UniPC
  flow_shift, FLUX's dynamic shifting).

Replicas: grouprl/replicas/diffusion.py. The shapes config's "replica" is its own velocity module
with fresh weights (model.weights null) instead of the demo's pretraining cache.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grouprl.cli import main as grouprl_main
from grouprl.config.loading import load_config
from grouprl.replicas import build_replica
from grouprl.runtime.checkpoint import CheckpointManager

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "diffusion"
PROMPT = "a red bicycle leaning against a brick wall"


@dataclass(frozen=True)
class Case:
    replica: str | None  # None: the config's own velocity module
    size: int  # image height = width
    rewards: tuple[str, ...] = ()  # CLIP-based rewards of the config, pointed at local replicas
    extra: tuple[str, ...] = ()


CASES = {
    "sd3_flow_grpo": Case("sd3.5-medium", 32, ("pickscore",)),
    "sd3_diffusion_nft": Case("sd3.5-medium", 32, ("pickscore",)),
    "flux_dance_grpo": Case("flux.1-dev", 32, ("clip_score", "pickscore"),
                            ("diffusion.rollout_steps=3",)),  # DanceGRPO trains 60% of T - 1
    "wan_flow_grpo": Case("wan2.1-t2v", 32, ("clip_score",), ("diffusion.num_frames=5",)),
    "sd15_ddpo": Case("sd1.5", 64),
    "shapes_flow_grpo": Case(None, 16, (), ("model.weights=null",)),
    "shapes_flow_grpo_judged": Case(None, 16, ("vlm_judge",), ("model.weights=null",)),
}  # fmt: skip
REWARD_REPLICA = {"pickscore": "pickscore", "clip_score": "clip-vit-large-patch14",
                  "vlm_judge": "qwen2-vl"}  # fmt: skip
# options naming the reward model's files: the CLIP rewards take a processor folder too
MODEL_OPTIONS = {"vlm_judge": ("model",)}


def test_every_shipped_diffusion_config_has_a_case():
    assert {p.stem for p in CONFIGS.glob("*.yaml")} == set(CASES)


# ---- building and running ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_replica(name, root / name)
        return built[name]

    return get


def overrides(name: str, replicas, out_dir: Path, model_path: str | None = None) -> list[str]:
    """Size-only overrides of config `name` (module docstring)."""
    case = CASES[name]
    over = [
        f"run.output_dir={out_dir}", "run.device=cpu", "run.console=false",
        "rollout.prompts_per_step=1", "rollout.group_size=2", "train.steps=2",
        "train.micro_batch_size=2", "diffusion.rollout_steps=2", "diffusion.eval_steps=2",
        f"diffusion.height={case.size}", f"diffusion.width={case.size}", "eval.max_examples=1",
        "eval.every=0", "checkpoint.every=0", *case.extra,
    ]  # fmt: skip
    if case.replica is not None:
        path = model_path or str(replicas(case.replica))
        over += [f"model.name_or_path={path}", "model.max_sequence_length=16"]
    if case.rewards:
        cfg = load_config(CONFIGS / f"{name}.yaml")
        rewards = []
        for r in cfg.rewards:
            if r.name not in REWARD_REPLICA:  # a reward without a model (color_area)
                rewards.append(r.model_dump(exclude_defaults=True))
                continue
            local = str(replicas(REWARD_REPLICA[r.name]))
            keys = MODEL_OPTIONS.get(r.name, ("model", "processor"))
            rewards.append({"name": r.name, "weight": r.weight,
                            "options": {**r.options, **{k: local for k in keys}}})  # fmt: skip
        over.append(f"rewards={json.dumps(rewards)}")
    return over


def run_cli(name: str, over: list[str], monkeypatch) -> Path:
    """`grouprl train configs/diffusion/<name>.yaml OVERRIDES`; returns the run directory."""
    monkeypatch.setenv("GROUPRL_DEBUG", "1")  # errors raise with their traceback
    rc = grouprl_main(["train", str(CONFIGS / f"{name}.yaml"), *over])
    assert rc == 0
    cfg = load_config(CONFIGS / f"{name}.yaml", over)
    return Path(cfg.run.output_dir) / cfg.run.name


@pytest.fixture(scope="module")
def trained(replicas, tmp_path_factory):
    """name -> (config, run directory) of its 2-step run, run once; a failed run re-raises."""
    runs: dict[str, tuple] = {}

    def get(name: str):
        if name not in runs:
            out = tmp_path_factory.mktemp(name)
            over = overrides(name, replicas, out)
            try:
                with pytest.MonkeyPatch.context() as mp:
                    run_dir = run_cli(name, over, mp)
                runs[name] = (load_config(CONFIGS / f"{name}.yaml", over), run_dir, None)
            except Exception as exc:  # kept: every test of this config reports it
                runs[name] = (None, None, exc)
        cfg, run_dir, exc = runs[name]
        if exc is not None:
            raise exc
        return cfg, run_dir

    return get


def train_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def _tensors(obj, prefix=""):
    """(name, tensor) of every tensor nested in dicts / lists / tuples."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}/{i}")


# ---- the checks --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_two_steps_in_own_dtype_all_saved_tensors_finite(trained, name):
    cfg, run_dir = trained(name)
    assert cfg.model.dtype == load_config(CONFIGS / f"{name}.yaml").model.dtype  # not overridden
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # float16: an overflow halves the loss scale and redoes the update
        assert r["skipped_nonfinite"] == 0.0, r
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
    ckpt = CheckpointManager(run_dir).latest()
    files = sorted(ckpt.rglob("*.safetensors"))
    assert files
    for f in files:
        for k, v in load_file(str(f)).items():
            assert torch.isfinite(v).all(), f"{f.relative_to(ckpt)}: {k} is not finite"
    for k, v in _tensors(CheckpointManager.load(ckpt)):
        if v.is_floating_point():
            assert torch.isfinite(v).all(), f"trainer state {k} is not finite"


@pytest.mark.parametrize("name", list(CASES))
def test_master_weights_and_optimizer_state_are_float32(trained, name):
    _, run_dir = trained(name)
    state = CheckpointManager.load(CheckpointManager(run_dir).latest())
    moments = [(k, v) for k, v in _tensors(state["optimizer"]["state"]) if v.dim() > 0]
    wrong = {k: str(v.dtype) for k, v in moments if v.dtype != torch.float32}
    assert moments and not wrong, f"optimizer state not in float32: {sorted(wrong.items())[:4]}"
    adapter = state["adapter"] or {}
    wrong = sorted({str(v.dtype) for v in adapter.values()} - {"torch.float32"})
    assert not wrong, f"trained adapter weights in {wrong}, not float32"


def _policy(cfg, ckpt: Path):
    """grouprl's trained policy: built from the run's config, weights from its checkpoint."""
    from grouprl.workloads import build_policy

    policy = build_policy(cfg, torch.device("cpu"))
    state = CheckpointManager.load(ckpt)
    if policy.lora is not None:
        policy.load_state_dict(state["adapter"])
    else:
        policy.load_saved_weights(ckpt / "model")
    return policy.eval()


def _denoise(policy, model, x, sigma, dtype):
    """One denoiser call through grouprl's family call, without CFG: [1, *latent] float32."""
    from grouprl.policies.flow.models import predict

    timestep = torch.tensor([500.0]) if policy.family.name == "unet" else sigma * 1000
    cond = policy.encode([PROMPT]) if policy.prompt_encoder is not None else None
    embeds = cond.embeds if cond is not None else {"class_labels": torch.tensor([3])}
    from grouprl.policies.precision import compute

    # as the policy calls it: under autocast in the run's dtype (Wan keeps some modules in float32,
    # so a plain cast of the inputs would not do; on a tiny replica the float32 LoRA weights can
    # outnumber the base's, so the dtype is the config's, not read off the weights)
    with torch.no_grad(), compute(dtype, "cpu"):
        return predict(policy.family, model, x, sigma=sigma, timestep=timestep, cond=embeds,
                       dtype=dtype,
                       negative=None, guidance_scale=torch.ones(1),
                       guidance=torch.full((1,), 3.5))  # fmt: skip


TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 5e-3}  # relative L2 error


@pytest.mark.parametrize("name", list(CASES))
def test_checkpoint_loads_where_users_load_it_and_matches_the_policy(trained, replicas, name):
    cfg, run_dir = trained(name)
    ckpt = CheckpointManager(run_dir).latest()
    policy = _policy(cfg, ckpt)
    dtype = getattr(torch, cfg.model.dtype)
    if CASES[name].replica is None:  # a user velocity module: its own from_pretrained
        from grouprl.demos.velocity import ShapesVelocityNet

        denoiser = ShapesVelocityNet.from_pretrained(ckpt / "model" / "transformer").eval()
    else:
        import diffusers

        pipe = diffusers.DiffusionPipeline.from_pretrained(
            replicas(CASES[name].replica), dtype=dtype
        )
        pipe.load_lora_weights(ckpt / "model")
        denoiser = pipe.unet if cfg.model.type == "unet" else pipe.transformer
        lora_b = [p for n, p in denoiser.named_parameters() if "lora_B" in n]
        assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # the trained adapter, loaded
    x = torch.randn(1, *policy.latent_shape, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.6])
    ours = _denoise(policy, policy.model, x, sigma, dtype)
    theirs = _denoise(policy, denoiser, x, sigma, dtype)
    err = float((ours - theirs).norm() / ours.norm())
    assert torch.isfinite(ours).all() and err <= TOLERANCE[cfg.model.dtype], err
    if CASES[name].replica is not None:  # the loaded pipeline draws finite images
        kw = {"num_frames": 5} if name == "wan_flow_grpo" else {}
        kw |= {} if cfg.model.type == "unet" else {"max_sequence_length": 16}
        out = pipe(prompt=PROMPT, num_inference_steps=2, height=CASES[name].size,
                   width=CASES[name].size, output_type="pt", **kw)  # fmt: skip
        images = out.frames if name == "wan_flow_grpo" else out.images
        assert torch.isfinite(torch.as_tensor(images)).all()


@pytest.mark.parametrize("name", list(CASES))
def test_a_new_run_starts_from_the_checkpoint(trained, replicas, name, tmp_path, monkeypatch):
    cfg, run_dir = trained(name)
    ckpt = CheckpointManager(run_dir).latest()
    if CASES[name].replica is None:
        start = [f"model.weights={ckpt / 'model' / 'transformer'}"]
        over = overrides(name, replicas, tmp_path) + start
    else:  # the ecosystem's way: fuse the LoRA into the pipeline and save the pipeline
        import diffusers

        pipe = diffusers.DiffusionPipeline.from_pretrained(replicas(CASES[name].replica))
        pipe.load_lora_weights(ckpt / "model")
        pipe.fuse_lora()
        pipe.unload_lora_weights()
        pipe.save_pretrained(tmp_path / "fused")
        over = overrides(name, replicas, tmp_path, model_path=str(tmp_path / "fused"))
    new_dir = run_cli(name, [*over, "train.steps=1"], monkeypatch)
    (row,) = train_rows(new_dir)
    assert math.isfinite(row["loss"]) and row["skipped_nonfinite"] == 0.0


def test_full_finetune_saves_a_pipeline_folder_diffusers_loads(replicas, tmp_path, monkeypatch):
    """sd3_diffusion_nft without LoRA: the checkpoint's model folder is a whole pipeline."""
    import diffusers

    over = overrides("sd3_diffusion_nft", replicas, tmp_path) + ["model.lora=null"]
    run_dir = run_cli("sd3_diffusion_nft", over, monkeypatch)
    ckpt = CheckpointManager(run_dir).latest()
    pipe = diffusers.DiffusionPipeline.from_pretrained(ckpt / "model", dtype=torch.bfloat16)
    assert type(pipe).__name__ == "StableDiffusion3Pipeline"
    cfg = load_config(CONFIGS / "sd3_diffusion_nft.yaml", over)
    policy = _policy(cfg, ckpt)
    x = torch.randn(1, *policy.latent_shape, generator=torch.Generator().manual_seed(0))
    ours = _denoise(policy, policy.model, x, torch.tensor([0.6]), torch.bfloat16)
    theirs = _denoise(policy, pipe.transformer, x, torch.tensor([0.6]), torch.bfloat16)
    assert float((ours - theirs).norm() / ours.norm()) <= TOLERANCE["bfloat16"]


# ---- the sampling schedule is the model's own ----------------------------------------------------

SCHEDULE_CASES = {  # replica -> the shipped config that names its family
    "sd3.5-medium": "sd3_flow_grpo",
    "flux.1-dev": "flux_dance_grpo",
    "flux.1-schnell": "flux_dance_grpo",
    "wan2.1-t2v": "wan_flow_grpo",
}


@pytest.mark.parametrize("rep", list(SCHEDULE_CASES))
def test_rollout_sigmas_are_the_pipelines_own(replicas, rep, tmp_path):
    """The sigmas a rollout steps through equal those the diffusers pipeline of the replica uses
    for the same number of steps and image size (shift, flow_shift, dynamic shifting). The config's
    own `diffusion.shift` is dropped so that the model's scheduler config decides; float32 keeps
    this check apart from the precision work."""
    import diffusers

    from grouprl.workloads import build_policy

    name, k = SCHEDULE_CASES[rep], 4
    over = overrides(name, replicas, tmp_path, model_path=str(replicas(rep)))
    over += ["model.dtype=float32", "diffusion.shift=null"]
    cfg = load_config(CONFIGS / f"{name}.yaml", over)
    policy = build_policy(cfg, torch.device("cpu"))
    rollout = policy.sample([PROMPT], 1, steps=k, mode="eval",
                            generator=torch.Generator().manual_seed(0))  # fmt: skip
    ours = rollout.actions.sigmas[0]  # [K+1]
    pipe = diffusers.DiffusionPipeline.from_pretrained(replicas(rep))
    kw = {"num_frames": cfg.diffusion.num_frames} if rep == "wan2.1-t2v" else {}
    pipe(prompt=PROMPT, num_inference_steps=k, height=cfg.diffusion.height,
         width=cfg.diffusion.width, output_type="latent", max_sequence_length=16, **kw)  # fmt: skip
    theirs = pipe.scheduler.sigmas.float()  # [K+1], the schedule the call stepped through
    assert ours.shape == theirs.shape and torch.allclose(ours, theirs, atol=1e-5), (ours, theirs)
