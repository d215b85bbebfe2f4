"""Images and agents under `accelerate launch` (2 gloo CPU processes) against one process, and
sharded evaluation (runtime/distributed Dist.map_examples) for text, agents and images.

Each test launches `accelerate launch --num_processes 2 -m grouprl train` in a subprocess (the
DDP config; gloo on this CPU machine) and runs the same config in-process with one process. With
rollout.seeding per_sample every group's samples depend only on its id and the weights, so both
runs train on the same batches: the final weights agree within float tolerance (row-split
scoring and the split update sum in another order; AdamW amplifies that where gradients are near
zero), and the evaluation metrics (split in whole eval batches, gathered) are equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_distributed import free_port, launch_two, max_diff

from grouprl.config.loading import apply_overrides, validate
from grouprl.runtime.checkpoint import CheckpointManager
from grouprl.runtime.distributed.dist import Dist
from grouprl.train import train

NET = {"channels": [8, 16], "emb_dim": 16, "groups": 4}


def _rows(run_dir: Path, split: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def _one_and_two(tmp_path: Path, raw_of) -> tuple[Path, Path]:
    """raw_of(out_dir) -> raw config; runs it with 2 processes, then 1; the two run dirs."""
    config_path = tmp_path / "cfg.yaml"
    config_path.write_text(yaml.safe_dump(raw_of(tmp_path / "two")))
    launch_two(config_path)
    one = train(validate(apply_overrides(raw_of(tmp_path / "one"), [])))
    return Path(one["run_dir"]), tmp_path / "two" / "r"


def _same_eval(one: Path, two: Path) -> None:
    e1, e2 = _rows(one, "eval"), _rows(two, "eval")
    assert len(e1) == len(e2) >= 2  # before and after training
    for a, b in zip(e1, e2):
        keys = {k for k in a if k.startswith("eval/")}
        assert keys == {k for k in b if k.startswith("eval/")} and keys
        for k in keys:
            assert b[k] == pytest.approx(a[k], abs=1e-6), k


# ---- images ---------------------------------------------------------------------------------------


def images_raw(out_dir: Path) -> dict:
    """A user velocity module on the shapes prompts at 8x8 (tests/test_diffusion_train.py)."""
    return {
        "run": {"name": "r", "output_dir": str(out_dir), "seed": 0, "device": "cpu",
                "console": False, "num_threads": 1},
        "workload": {"type": "images"},
        "model": {"type": "flow", "name_or_path": "grouprl.demos.velocity:ShapesVelocityNet",
                  "module_options": NET, "condition": "class_label", "null_label": 12,
                  "lora": None},
        "task": {"name": "image_prompts", "options": {"source": "shapes", "n_eval": 3}},
        "rollout": {"prompts_per_step": 3, "group_size": 4, "seeding": "per_sample"},
        "algorithm": {"preset": "flow_grpo", "kl_coef": 0.01},
        "diffusion": {"height": 8, "width": 8, "rollout_steps": 3, "eval_steps": 3,
                      "guidance_scale": 1.0},
        "eval": {"every": 2, "batch_size": 1},
        "train": {"steps": 2, "lr": 1e-3},
    }  # fmt: skip


def test_images_two_processes_reach_the_weights_and_eval_of_one(tmp_path):
    one, two = _one_and_two(tmp_path, images_raw)
    name = "transformer/diffusion_pytorch_model.safetensors"
    w1 = load_file(CheckpointManager(one).latest() / "model" / name)
    w2 = load_file(CheckpointManager(two).latest() / "model" / name)
    torch.manual_seed(0)  # seed_everything(run.seed) runs just before the model is built
    from grouprl.demos.velocity import ShapesVelocityNet

    w0 = ShapesVelocityNet(**NET).state_dict()
    assert max_diff(w1, w0) > 1e-3  # training moved the weights
    assert max_diff(w1, w2) < 5e-5
    for a, b in zip(_rows(one, "train"), _rows(two, "train")):  # the same images and rewards
        assert b["reward/mean"] == pytest.approx(a["reward/mean"], abs=1e-6)
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    _same_eval(one, two)
    assert (two / "images" / "step-00000002.png").exists()  # the grid, from the main process


def test_images_refuse_forward_noising_objectives_under_several_processes(tmp_path):
    from grouprl.workloads.base import Parts
    from grouprl.workloads.images import ImagesWorkload

    cfg = validate(apply_overrides(images_raw(tmp_path), ["algorithm.preset=diffusion_nft"]))
    two = Dist()
    two.world = 2
    with pytest.raises(ValueError, match="diffusion_nft.*2 processes"):
        ImagesWorkload(Parts(cfg, None, {}, {}, two))


# ---- agents ---------------------------------------------------------------------------------------


def agent_raw(model_dir: Path):
    def raw(out_dir: Path) -> dict:
        return {
            "run": {"name": "r", "output_dir": str(out_dir), "seed": 0, "device": "cpu",
                    "console": False, "num_threads": 1},
            "workload": {"type": "agent"},
            "model": {"name_or_path": str(model_dir)},
            "task": {"name": "env", "options": {"env_id": "grouprl/FrozenLake-v0",
                                                "env_kwargs": {"max_steps": 3}, "n_eval": 3}},
            "agent": {"max_turns": 2, "max_turn_tokens": 6, "max_total_tokens": 400},
            "rollout": {"prompts_per_step": 2, "group_size": 3, "stop": ["</action>"],
                        "seeding": "per_sample"},
            "algorithm": {"preset": "gigpo", "kl_coef": 0.0},
            "eval": {"every": 2, "pass_k": 2},
            "train": {"steps": 2, "lr": 1e-3},
        }  # fmt: skip

    return raw


def test_agents_two_processes_reach_the_weights_and_eval_of_one(tmp_path, tiny_model_dir):
    one, two = _one_and_two(tmp_path, agent_raw(tiny_model_dir))
    w1 = load_file(CheckpointManager(one).latest() / "model" / "model.safetensors")
    w2 = load_file(CheckpointManager(two).latest() / "model" / "model.safetensors")
    w0 = load_file(tiny_model_dir / "model.safetensors")
    assert max_diff(w1, w0) > 1e-3
    assert max_diff(w1, w2) < 5e-5
    for a, b in zip(_rows(one, "train"), _rows(two, "train")):  # the same episodes
        assert b["episode/return"] == a["episode/return"]
        assert b["episode/turns"] == a["episode/turns"]
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    _same_eval(one, two)


# ---- text: sharded evaluation -----------------------------------------------------------------------


def test_text_evaluation_is_split_and_equals_one_process(tmp_path, tiny_model_dir):
    """3 held-out problems in eval batches of 1 over 2 processes (2 + 1), greedy accuracy, length
    and per-sample seeded pass@2: the gathered metrics equal one process's."""
    from test_distributed import REWARDS_PY, two_process_raw

    reward_file = tmp_path / "rewards.py"
    reward_file.write_text(REWARDS_PY)

    def raw(out_dir: Path) -> dict:
        r = two_process_raw(out_dir, tiny_model_dir, reward_file)
        r["task"]["options"]["n_eval"] = 3
        r["train"]["steps"] = 1
        r["workload"] = {"type": "text"}
        r["eval"] = {"batch_size": 1, "pass_k": 2}
        return r

    one, two = _one_and_two(tmp_path, raw)
    _same_eval(one, two)
    assert "eval/pass@2" in _rows(two, "eval")[0]


def map_worker(rank: int, port: int, out_dir: str) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        d = Dist(seed=3)
        d.rank, d.world = rank, 2
        torch.manual_seed(0)
        before = torch.get_rng_state()

        def run(part, first):  # draws from torch's RNG, as sampled evaluation does
            return [(rank, first + i, x, float(torch.rand(1))) for i, x in enumerate(part)]

        got = {u: d.map_examples(list("abcde"), run, unit=u) for u in (1, 2)}
        assert torch.equal(torch.get_rng_state(), before)  # the global RNG did not move
        torch.save(got, Path(out_dir) / f"{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_map_examples_splits_whole_units_and_gathers_in_order(tmp_path):
    """2 gloo processes: process 0 evaluates the first units, process 1 the rest (units of 2: the
    eval batches [a b] [c d] | [e]), every process gets every result in example order."""
    import os
    import subprocess
    import sys

    port = free_port()
    # spawned from a child interpreter: mp.spawn leaves a resource-tracker process behind in the
    # process that calls it, which later tests that count this process's descendants would see
    root = Path(__file__).resolve().parents[1]
    code = (
        "import torch.multiprocessing as mp\n"
        "from tests.test_distributed_workloads import map_worker\n"
        f"mp.spawn(map_worker, args=({port}, {str(tmp_path)!r}), nprocs=2)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}",
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = [torch.load(tmp_path / f"{r}.pt") for r in (0, 1)]
    assert got[0] == got[1]
    for unit, owners in ((1, [0, 0, 0, 1, 1]), (2, [0, 0, 0, 0, 1])):
        res = got[0][unit]
        assert [r[2] for r in res] == list("abcde") and [r[1] for r in res] == list(range(5))
        assert [r[0] for r in res] == owners


def test_map_examples_one_process_is_the_function_itself():
    single = Dist()
    got = single.map_examples([10, 20, 30], lambda part, first: [(first, x) for x in part], unit=2)
    assert got == [(0, 10), (0, 20), (0, 30)]


def test_a_per_sample_seeded_image_group_does_not_depend_on_the_batch_or_the_global_rng(tmp_path):
    from grouprl.envs.tasks import build_task
    from grouprl.workloads import build_policy, build_rewards
    from grouprl.workloads.images import sampling as images

    cfg = validate(apply_overrides(images_raw(tmp_path), []))
    torch.manual_seed(0)
    policy = build_policy(cfg, torch.device("cpu"))
    task = build_task(cfg.task.name, **cfg.task.options)
    rewards, _ = build_rewards(cfg, task)
    exs = task.train[:3]
    both, _ = images.collect(cfg, policy, exs, rewards, first_group_id=5, seed=0)
    state = torch.get_rng_state()
    alone, _ = images.collect(cfg, policy, exs[1:2], rewards, first_group_id=6, seed=0)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG was not used
    g = cfg.rollout.group_size
    assert torch.equal(both.actions.latents[g : 2 * g], alone.actions.latents)
    assert torch.equal(both.rewards["color_area"][g : 2 * g], alone.rewards["color_area"])
    other, _ = images.collect(cfg, policy, exs[1:2], rewards, first_group_id=6, seed=1)
    assert not torch.equal(other.actions.latents, alone.actions.latents)
