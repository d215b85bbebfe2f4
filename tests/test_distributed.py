"""grouprl.runtime.distributed.dist: per-sample seeded sampling, the per-process split of every minibatch, and
`accelerate launch` with 2 CPU processes (gloo) against one process on the same global batch.

The end-to-end test launches `accelerate launch --config_file configs/accelerate/ddp.yaml
--num_processes 2 -m grouprl train` in a subprocess (torchrun under the hood; on this CPU-only
machine the DDP config starts gloo processes) and compares its final weights with an in-process
one-process run. Tolerance: AdamW normalises every coordinate's gradient, so the floating-point
summation-order noise between "sum of two half-batch gradients" and "one full-batch gradient" is
amplified in coordinates whose gradient is near zero; measured max |difference| 3.4e-6 after 3
steps in which weights move by 3e-3. We allow 5e-5 and require the weights to have moved by
1e-3 (so the comparison means something).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from grouprl.config.loading import apply_overrides, validate
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.policies.text.engines.seeded import SeededChoice
from grouprl.rollouts.batching import fill_micro_batches, split_batch
from grouprl.rollouts.filters import cat_rollouts
from grouprl.rollouts.seeds import group_seeds, sample_seed
from grouprl.runtime.checkpoint import CheckpointManager
from grouprl.runtime.distributed.dist import SINGLE, Dist, NullLogger
from grouprl.train import train
from grouprl.types import Rollout, TokenBatch

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE_CONFIGS = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))

# ---- per-sample seeded sampling -----------------------------------------------------------------


def test_sample_seeds_are_stable_and_distinct():
    # pinned: a resumed run (a new process, another PYTHONHASHSEED) must draw the same seeds
    assert sample_seed(0, 5, 1) == 3522800990720111236
    seeds = {sample_seed(s, g, j) for s in (0, 1) for g in range(50) for j in range(8)}
    assert len(seeds) == 2 * 50 * 8 and all(0 <= x < 2**63 for x in seeds)
    assert group_seeds(3, [7, 9], 2) == [sample_seed(3, g, j) for g in (7, 9) for j in (0, 1)]


def test_seeded_choice_is_inverse_cdf_of_the_rows_own_uniform():
    probs = torch.tensor([0.2, 0.5, 0.3])
    seen = set()
    for seed in range(40):
        u = float(torch.rand(1, generator=torch.Generator().manual_seed(seed)))
        expected = 0 if u < 0.2 else (1 if u < 0.7 else 2)  # cdf 0.2, 0.7, 1.0
        out = SeededChoice([seed])(None, probs.log().unsqueeze(0))  # [1, 3]
        assert out[0, expected] == 0 and torch.isinf(out[0]).sum() == 2
        seen.add(expected)
    assert seen == {0, 1, 2}


def test_seeded_choice_follows_the_distribution_and_skips_masked_tokens():
    scores = torch.tensor([[0.0, 1.0, -float("inf"), 2.0]]).expand(4000, 4)  # token 2 masked
    chosen = SeededChoice(list(range(4000)))(None, scores).argmax(-1)  # [4000]
    freq = torch.bincount(chosen, minlength=4).float() / 4000
    assert freq[2] == 0
    torch.testing.assert_close(freq, torch.softmax(scores[0], -1), atol=0.03, rtol=0)


def test_a_seeded_group_does_not_depend_on_the_batch_or_the_global_rng(tiny_model, tiny_tokenizer):
    policy = CausalLMPolicy(tiny_model, tiny_tokenizer)
    params = SamplingParams(max_new_tokens=6, top_k=20)
    big = policy.sample(["1+2=", "13+4=", "7+7="], 3, params, group_ids=[5, 6, 7], seed=11)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    alone = policy.sample(["13+4="], 3, params, group_ids=[6], seed=11)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG was not used
    assert big.info["completion_ids"][3:6] == alone.info["completion_ids"]
    width = alone.engine_logp.shape[1]
    torch.testing.assert_close(big.engine_logp[3:6, :width], alone.engine_logp, rtol=0, atol=1e-6)
    other = policy.sample(["13+4="], 3, params, group_ids=[6], seed=12)
    assert other.info["completion_ids"] != alone.info["completion_ids"]


# ---- the split of every minibatch over processes -------------------------------------------------


def _rollout(group_sizes):
    ids = torch.cat([torch.full((g,), i) for i, g in enumerate(group_sizes)])  # [N]
    n = len(ids)
    return Rollout(ids, {}, None, torch.zeros(n, 2), torch.ones(n, 2, dtype=torch.bool))


def _fake(rank, world):
    d = Dist()
    d.rank, d.world, d.backend = rank, world, object()
    return d


def _splits(rollout, world, *args, **kwargs):
    out = []
    for rank in range(world):
        torch.manual_seed(0)  # every process's global RNG is in the same state
        out.append(list(_fake(rank, world).split_batch(rollout, *args, **kwargs)))
    return out


def test_every_process_gets_a_disjoint_share_of_each_global_minibatch():
    rollout = _rollout([4, 4, 4])  # N = 12
    splits = _splits(rollout, 2, 2, 2, whole_groups=False)
    torch.manual_seed(0)
    single = list(split_batch(rollout, 2, 2, whole_groups=False))
    assert len(splits[0]) == len(splits[1]) == len(single) == 2  # two optimizer updates
    for u, (mb, _) in enumerate(single):
        assert torch.equal(splits[0][u][0], mb) and torch.equal(splits[1][u][0], mb)
        rows = [torch.cat(splits[r][u][1]).tolist() for r in range(2)]
        assert len(rows[0]) == len(rows[1]) == 3  # 6 samples: 3 per process
        assert not set(rows[0]) & set(rows[1])
        assert sorted(rows[0] + rows[1]) == sorted(mb.tolist())
        # micro-batches of at most 2 samples: [2, 1] on each process
        assert [len(m) for m in splits[0][u][1]] == [len(m) for m in splits[1][u][1]] == [2, 1]


def test_a_process_short_of_groups_runs_a_padding_micro_batch():
    rollout = _rollout([4, 4, 4])
    (r0,), (r1,) = _splits(rollout, 2, 1, 4, whole_groups=True)
    assert [len(m) for m in r0[1]] == [4, 4]  # two whole groups
    assert [len(m) for m in r1[1]] == [4, 0]  # one group, then padding
    for m in r0[1] + r1[1]:
        assert len(torch.unique(rollout.group_ids[m])) <= 1  # a group is never split
    assert sorted(torch.cat(r0[1] + r1[1]).tolist()) == list(range(12))


def test_padding_is_a_real_row_trained_with_weight_zero():
    class Recorder:
        def backward(self, loss):
            seen.append(float(loss))

    seen, rollout = [], _rollout([2, 2])
    d = _fake(1, 2)
    d.backend = Recorder()
    sub = d.select(rollout, torch.empty(0, dtype=torch.long))
    assert len(sub) == 1
    d.backward(torch.tensor(3.0))
    d.select(rollout, torch.tensor([2, 3]))
    d.backward(torch.tensor(3.0))
    assert seen == [0.0, 6.0]  # x 0 for padding, x world otherwise (gradient averaging undone)


def test_gathered_rollouts_pad_each_field_with_its_own_value():
    def part(n, t, group):
        batch = TokenBatch(torch.ones(n, 2, dtype=torch.long), torch.ones(n, 2, dtype=torch.bool),
                           torch.ones(n, t, dtype=torch.long), torch.ones(n, t, dtype=torch.bool),
                           torch.zeros(n, dtype=torch.bool))  # fmt: skip
        return Rollout(
            torch.full((n,), group), {"r": torch.ones(n)}, batch, torch.ones(n, t),
            torch.ones(n, t, dtype=torch.bool), step_ids=torch.zeros(n, t, dtype=torch.long),
            step_rewards=torch.ones(n, 4), anchor_keys=[["a"]] * n, info={"x": [group] * n},
        )  # fmt: skip

    joined = cat_rollouts([part(1, 2, 0), part(2, 3, 1)])
    assert joined.group_ids.tolist() == [0, 1, 1] and joined.rewards["r"].shape == (3,)
    assert joined.step_ids[0].tolist() == [0, 0, -1]  # -1: no turn, not turn 0
    assert joined.mask[0].tolist() == [True, True, False] and joined.old_logp[0, 2] == 0
    assert joined.step_rewards.shape == (3, 4)  # per-turn, not per-token: never padded
    assert joined.actions.completion_ids.shape == (3, 3) and joined.info["x"] == [0, 1, 1]
    assert joined.anchor_keys == [["a"]] * 3


def test_fill_packs_whole_units_like_batching():
    units = [torch.tensor([0, 1]), torch.tensor([2]), torch.tensor([3, 4, 5])]
    assert [m.tolist() for m in fill_micro_batches(units, 3)] == [[0, 1, 2], [3, 4, 5]]
    assert [m.tolist() for m in fill_micro_batches(units, None)] == [[0, 1, 2, 3, 4, 5]]
    assert fill_micro_batches([], 2) == []


def test_one_process_helpers_are_the_single_process_code():
    assert SINGLE.all_gather_object({"a": 1}) == [{"a": 1}]
    assert SINGLE.sum_counts({"x": 2.0}) == {"x": 2.0}
    assert SINGLE.sum_metrics({"kl": 1.0}, {"loss": 2.0}, 3) == ({"kl": 1.0}, {"loss": 2.0}, 3)
    assert SINGLE.all_finite([{"loss": 1.0}], [torch.tensor([0])])
    assert not SINGLE.all_finite([], [torch.tensor([0])])
    with NullLogger("x", 3) as log:
        assert log.log(1, {"a": 1.0}) is None


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_configs_load(path):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(path))
    assert cfg.mixed_precision == "no"  # precision comes from grouprl's model.dtype
    if cfg.distributed_type.value == "FSDP":
        assert cfg.fsdp_config["fsdp_version"] == 2
    if cfg.distributed_type.value == "DEEPSPEED":
        assert cfg.deepspeed_config["gradient_accumulation_steps"] == 1


# ---- 2 processes (accelerate launch, gloo) == 1 process ------------------------------------------

REWARDS_PY = """
def parity(completions, **_):
    return [float(sum(map(ord, c)) % 2) for c in completions]
"""


def two_process_raw(out_dir, model_dir, reward_file):
    return {
        "run": {"name": "r", "output_dir": str(out_dir), "seed": 0, "device": "cpu",
                "console": False, "num_threads": 1},
        "model": {"name_or_path": str(model_dir)},
        "task": {"name": "arithmetic",
                 "options": {"n_train": 16, "n_eval": 2, "ops": "+", "max_value": 9}},
        "rewards": [{"name": "accuracy"}, {"name": f"{reward_file}:parity"}],
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 4,
                    "seeding": "per_sample"},
        "train": {"steps": 3, "lr": 1e-3},
        "checkpoint": {"every": 2, "keep_last": 3},
    }  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two(config_path, *overrides, entry=None):
    """`grouprl train config_path *overrides` on 2 gloo processes (accelerate launch); entry: a
    script to run instead of `-m grouprl` (one that patches something first, e.g. FORCE_FSDP2)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    program = [str(entry)] if entry is not None else ["-m", "grouprl"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           "--config_file", str(ROOT / "configs" / "accelerate" / "ddp.yaml"),
           "--num_processes", "2", "--main_process_port", str(free_port()),
           *program, "train", str(config_path), *overrides]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _weights(ckpt):
    return load_file(ckpt / "model" / "model.safetensors")


def _train_rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_two_processes_reach_the_weights_of_one_and_resume_on_one(tiny_model_dir, tmp_path):
    reward_file = tmp_path / "rewards.py"
    reward_file.write_text(REWARDS_PY)
    config_path = tmp_path / "cfg.yaml"
    config_path.write_text(
        yaml.safe_dump(two_process_raw(tmp_path / "two", tiny_model_dir, reward_file))
    )
    launch_two(config_path)
    one = train(
        validate(
            apply_overrides(two_process_raw(tmp_path / "one", tiny_model_dir, reward_file), [])
        )
    )

    one_dir, two_dir = Path(one["run_dir"]), tmp_path / "two" / "r"
    steps = [p.name for p in CheckpointManager(two_dir).complete()]
    assert steps == ["step-00000002", "step-00000003"]  # written once, by the main process
    w1 = _weights(CheckpointManager(one_dir).latest())
    w2 = _weights(CheckpointManager(two_dir).latest())
    w0 = load_file(tiny_model_dir / "model.safetensors")
    assert max_diff(w1, w0) > 1e-3  # training moved the weights
    assert max_diff(w1, w2) < 5e-5
    rows1, rows2 = _train_rows(one_dir), _train_rows(two_dir)
    assert [r["step"] for r in rows2] == [1, 2, 3]  # one log line per step (main process only)
    for a, b in zip(rows1, rows2):  # the same samples and rewards; losses equal up to rounding
        assert a["reward/mean"] == b["reward/mean"]
        assert a["response_length/mean"] == b["response_length/mean"]
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)

    # resume the 2-process run's step-2 checkpoint with ONE process: step 3 again
    resumed = tmp_path / "resumed" / "r"
    shutil.copytree(two_dir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-00000003")
    raw = two_process_raw(tmp_path / "resumed", tiny_model_dir, reward_file)
    train(validate(apply_overrides(raw, ["run.resume=true"])))
    assert max_diff(w1, _weights(CheckpointManager(resumed).latest())) < 5e-5


# ---- FSDP2 through accelerate, forced onto CPU processes ----------------------------------------

FORCE_FSDP2 = '''
"""grouprl train with accelerate's FSDP2 path on CPU processes: accelerate runs FSDP on GPUs only,
so the distributed type is set to FSDP (fsdp_version 2) after the Accelerator is made; everything
else (accelerate's _prepare_fsdp2 / fully_shard, gloo collectives) is the real code path."""
import sys

import accelerate
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

make = accelerate.Accelerator.__init__


def init(self, *args, **kwargs):
    make(self, *args, **kwargs)
    self.state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True,
        state_dict_type="FULL_STATE_DICT", cpu_ram_efficient_loading=False,
    )
    self.state.distributed_type = DistributedType.FSDP


accelerate.Accelerator.__init__ = init
from grouprl.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
'''


@pytest.mark.slow
def test_fsdp2_two_processes_reach_the_weights_of_one_and_resume_on_one(tiny_model_dir, tmp_path):
    """Parameters, gradients and AdamW moments sharded (DTensors); generation and saving from the
    refreshed plain copy; the optimizer state saved whole in torch's layout (measured: 2.1e-6)."""
    reward_file = tmp_path / "rewards.py"
    reward_file.write_text(REWARDS_PY)
    script = tmp_path / "force_fsdp2.py"
    script.write_text(FORCE_FSDP2)
    config_path = tmp_path / "cfg.yaml"
    config_path.write_text(
        yaml.safe_dump(two_process_raw(tmp_path / "two", tiny_model_dir, reward_file))
    )
    launch_two(config_path, entry=script)
    one = train(
        validate(
            apply_overrides(two_process_raw(tmp_path / "one", tiny_model_dir, reward_file), [])
        )
    )
    two_dir = tmp_path / "two" / "r"
    w1 = _weights(CheckpointManager(Path(one["run_dir"])).latest())
    assert max_diff(w1, _weights(CheckpointManager(two_dir).latest())) < 5e-5
    state = CheckpointManager.load(two_dir / "checkpoints" / "step-00000002")
    assert sorted(state["optimizer"]["state"])[:2] == [0, 1]  # torch's layout, whole
    shutil.rmtree(two_dir / "checkpoints" / "step-00000003")
    raw = two_process_raw(tmp_path / "two", tiny_model_dir, reward_file)
    train(validate(apply_overrides(raw, ["run.resume=true"])))  # one process resumes it
    assert max_diff(w1, _weights(CheckpointManager(two_dir).latest())) < 5e-5
