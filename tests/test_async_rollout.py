"""grouprl.runtime.async_rollout: one-step-off-policy training (train.async_mode = "one_step_off").

- With async_staleness 0 the background worker reproduces the synchronous run bit for bit.
- With staleness 1, batch k+1 is sampled by the weights held before update k (one step stale), the
  worker's old_logp are the sampling weights' log-probs, generation overlaps the update in time,
  and a checkpoint sees the sampler as it was before the in-flight batch was drawn.
"""

import copy
import json
import multiprocessing as mp
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from grouprl.config.loading import apply_overrides, validate
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.rollouts.batching import recompute_old, single_pass
from grouprl.rollouts.single_turn import collect
from grouprl.runtime.async_rollout import (
    OneStepOff,
    SyncRollouts,
    check_async,
    rollout_source,
)
from grouprl.runtime.checkpoint import CheckpointManager
from grouprl.train import train

REWARDS_PY = """
def parity(completions, **_):
    return [float(sum(map(ord, c)) % 2) for c in completions]
"""


def _cfg(tmp_path, model_dir, *overrides, name="run"):
    reward_file = tmp_path / "rewards.py"
    reward_file.write_text(REWARDS_PY)
    raw = {
        "run": {"name": name, "output_dir": str(tmp_path), "seed": 0, "device": "cpu",
                "console": False},
        "model": {"name_or_path": str(model_dir)},
        "task": {"name": "arithmetic",
                 "options": {"n_train": 16, "n_eval": 2, "ops": "+", "max_value": 9}},
        "rewards": [{"name": "accuracy"}, {"name": f"{reward_file}:parity"}],
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 4},
        "train": {"steps": 3, "lr": 1e-3},
    }  # fmt: skip
    return validate(apply_overrides(raw, list(overrides)))


def _final(run_dir):
    return load_file(CheckpointManager(run_dir).latest() / "model" / "model.safetensors")


def _train_rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_staleness_zero_reproduces_the_synchronous_run_exactly(tiny_model_dir, tmp_path, worker):
    sync = train(_cfg(tmp_path, tiny_model_dir, name="sync"))
    off = train(_cfg(tmp_path, tiny_model_dir, "train.async_mode=one_step_off",
                     "train.async_staleness=0", f"train.async_worker={worker}",
                     name="async0"))  # fmt: skip
    a, b = _final(sync["run_dir"]), _final(off["run_dir"])
    w0 = load_file(tiny_model_dir / "model.safetensors")
    assert max(float((a[k] - w0[k]).abs().max()) for k in a) > 1e-3  # training moved them
    assert all(torch.equal(a[k], b[k]) for k in a)  # global seeding: the same RNG draws too
    rows_sync, rows_async = _train_rows(tmp_path / "sync"), _train_rows(tmp_path / "async0")
    for r, s in zip(rows_sync, rows_async):
        assert (r["loss"], r["reward/mean"], r["grad_norm"]) == (
            s["loss"], s["reward/mean"], s["grad_norm"],
        )  # fmt: skip
        assert "async/wait_s" in s and "async/rollout_s" in s


def test_one_step_off_runs_and_corrects_for_staleness(tiny_model_dir, tmp_path):
    cfg = _cfg(
        tmp_path, tiny_model_dir, "train.async_mode=one_step_off", "rollout.seeding=per_sample"
    )
    train(cfg)
    rows = _train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert abs(rows[0]["loss"]) < 1e-6  # batch 1: sampled by the weights it trains: ratio 1
    # batches 2 and 3 were sampled one update earlier: ratio != 1, the clipped ratio acts
    assert any(abs(r["loss"]) > 1e-5 for r in rows[1:])
    assert all(r["async/rollout_s"] > 0 for r in rows)


# ---- the worker's timeline with a stand-in for rollout_step --------------------------------------


class Sampler:
    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def _source(policy, staleness, make, steps=4, old_logp="recompute", worker="thread"):
    cfg = SimpleNamespace(
        train=SimpleNamespace(async_staleness=staleness, steps=steps, async_worker=worker),
        rollout=SimpleNamespace(old_logp=old_logp, temperature=1.0),
    )
    sampler = Sampler()
    return OneStepOff(cfg, policy, sampler, lambda step, pol: make(step, pol, sampler)), sampler


def _first_weight(policy):
    return next(policy.model.parameters()).view(-1)[0]


@pytest.mark.parametrize("worker", ["thread", "process"])
@pytest.mark.parametrize("staleness, expected", [(1, [0.0, 0.0, 1.0, 2.0]), (0, [0, 1, 2, 3])])
def test_batch_k_plus_1_is_sampled_by_the_weights_before_update_k(
    tiny_model, tiny_tokenizer, staleness, expected, worker
):
    policy = CausalLMPolicy(tiny_model, tiny_tokenizer)
    with torch.no_grad():
        _first_weight(policy).fill_(0.0)

    def make(step, pol, sampler):
        assert pol is not policy  # the worker samples with the snapshot, never the live model
        sampler.position += 1
        return None, {"w": float(_first_weight(pol))}

    source, sampler = _source(policy, staleness, make, worker=worker)
    seen = []
    for step in range(4):
        _, metrics = source.next(step, policy)
        seen.append(metrics["w"])
        with torch.no_grad():  # "update `step`": the live weights change
            _first_weight(policy).fill_(step + 1.0)
    source.close()
    assert seen == expected
    assert sampler.position == 4  # the process worker's draws are mirrored in the trainer


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_generation_overlaps_the_update(monkeypatch, worker):
    import grouprl.runtime.async_rollout as mod

    # a stand-in policy: taking a snapshot and copying weights are instant, sampling takes 0.2 s
    model = torch.nn.Linear(1, 1)
    stand_in = SimpleNamespace(snapshot=lambda: SimpleNamespace(model=model))
    monkeypatch.setattr(mod, "copy_weights", lambda policy, snapshot: None)

    def make(step, pol, sampler):
        time.sleep(0.2)
        return None, {"where": f"{mp.current_process().name}/{threading.current_thread().name}"}

    def run(staleness):
        source, _ = _source(stand_in, staleness, make, steps=5, worker=worker)
        start = time.perf_counter()
        for step in range(5):
            _, metrics = source.next(step, None)
            assert "grouprl-rollout" in metrics["where"]  # not the trainer's thread
            time.sleep(0.2)  # the update
        source.close()
        return time.perf_counter() - start

    overlapped, serial = run(1), run(0)
    # serial: 5 x (0.2 + 0.2) = 2.0 s; overlapped: 0.2 + 5 x 0.2 = 1.2 s (sleeps: load-proof)
    assert overlapped < 0.8 * serial, (overlapped, serial)


def test_old_logp_are_the_sampling_weights_score(tiny_model, tiny_tokenizer):
    policy = CausalLMPolicy(tiny_model, tiny_tokenizer)
    sampling = CausalLMPolicy(copy.deepcopy(tiny_model), tiny_tokenizer)
    params = SamplingParams(max_new_tokens=4)
    examples = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "4+4=", "answer": "8"}]

    def make(step, pol, sampler):
        return collect(pol, examples, 3, params, {}, first_group_id=step * 2, seed=step)

    source, _ = _source(policy, 1, make, steps=2)
    source.next(0, policy)  # launches batch 1 with the current (initial) weights
    with torch.no_grad():  # update 0 changes the live weights while batch 1 is sampled
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rollout, _ = source.next(1, policy)
    source.close()
    with torch.no_grad():
        by_sampler = sampling.log_probs(rollout.actions, with_entropy=False).logp  # [N, T]
        by_current = policy.log_probs(rollout.actions, with_entropy=False).logp
    mask = rollout.mask
    torch.testing.assert_close(rollout.old_logp[mask], by_sampler[mask], rtol=0, atol=1e-5)
    assert (rollout.old_logp[mask] - by_current[mask]).abs().max() > 1e-3
    # the engine's own log-probs of the same tokens agree with the sampler's score
    torch.testing.assert_close(rollout.engine_logp[mask], by_sampler[mask], rtol=0, atol=1e-4)


def test_a_checkpoint_sees_the_sampler_before_the_in_flight_batch(tiny_model, tiny_tokenizer):
    policy = CausalLMPolicy(tiny_model, tiny_tokenizer)
    gate = threading.Event()

    def make(step, pol, sampler):
        sampler.position += 10  # this batch's draws
        gate.wait(5)
        return None, {}

    source, sampler = _source(policy, 1, make)
    gate.set()
    source.next(0, policy)  # batch 0 done (position 10); batch 1 in flight
    gate.clear()
    time.sleep(0.05)
    assert sampler.position == 20  # the worker already drew batch 1
    assert source.saved_sampler(sampler).state_dict() == {"position": 10}
    gate.set()
    source.close()


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_a_worker_error_surfaces_at_the_next_step(tiny_model, tiny_tokenizer, worker):
    policy = CausalLMPolicy(tiny_model, tiny_tokenizer)

    def make(step, pol, sampler):
        if step == 1:
            raise RuntimeError("reward server down")
        return None, {}

    source, _ = _source(policy, 1, make, worker=worker)
    source.next(0, policy)
    with pytest.raises(RuntimeError, match="reward server down"):
        source.next(1, policy)
    source.close()


# ---- configuration -------------------------------------------------------------------------------


def test_unsupported_combinations_are_refused(tiny_model_dir, tmp_path):
    on = "train.async_mode=one_step_off"
    with pytest.raises(ValueError, match="several processes"):
        check_async(_cfg(tmp_path, tiny_model_dir, on), world=2)
    with pytest.raises(ValueError, match="vllm"):
        check_async(_cfg(tmp_path, tiny_model_dir, on, "rollout.engine=vllm"), world=1)
    with pytest.raises(ValueError, match="curriculum.type 'dump'"):
        check_async(_cfg(tmp_path, tiny_model_dir, on, "curriculum.type=dump"), world=1)
    with pytest.raises(ValueError, match="'process' on CUDA"):
        check_async(_cfg(tmp_path, tiny_model_dir, on, "train.async_worker=process",
                         "run.device=cuda"), world=1)  # fmt: skip
    with pytest.raises(ValueError, match="timeout_s"):
        check_async(_cfg(tmp_path, tiny_model_dir, on, "train.async_worker=process",
                         "rewards.0.timeout_s=5"), world=1)  # fmt: skip
    check_async(_cfg(tmp_path, tiny_model_dir, "rollout.engine=vllm"), world=2)  # off: anything
    with pytest.raises(ValueError):
        _cfg(tmp_path, tiny_model_dir, on, "train.async_staleness=2")


def test_prepare_never_recomputes_old_logp_under_one_step_off(tiny_model_dir, tmp_path):
    sync = _cfg(tmp_path, tiny_model_dir, "algorithm.epochs=2")
    assert recompute_old(sync) and not single_pass(sync)
    off = _cfg(tmp_path, tiny_model_dir, "algorithm.epochs=2", "train.async_mode=one_step_off")
    assert not recompute_old(off) and not single_pass(off)  # the worker scored pi_old already
    one = _cfg(tmp_path, tiny_model_dir, "train.async_mode=one_step_off")  # 1 epoch, 1 minibatch
    assert not single_pass(one)  # sampled by the previous weights: never the update's own forward
    assert single_pass(_cfg(tmp_path, tiny_model_dir)) and not recompute_old(
        _cfg(tmp_path, tiny_model_dir)
    )
    assert off.rollout.old_logp == "recompute"  # the run's own config is untouched
    assert isinstance(rollout_source(sync, None, None, lambda s, p: (None, {})), SyncRollouts)


def test_the_rollout_process_reports_a_failure_a_death_and_leaves_no_process():
    import os

    from grouprl.runtime.async_worker import ProcessRunner

    def job(what):
        if what == "raise":
            raise ValueError("bad batch")
        if what == "exit":
            os._exit(3)
        return what * 2

    runner = ProcessRunner(job)
    pid = runner.worker.pid
    assert runner.submit(21).result() == 42
    with pytest.raises(RuntimeError, match=r"(?s)failed:\n.*ValueError: bad batch"):
        runner.submit("raise").result()
    with pytest.raises(RuntimeError, match=r"died \(.*exit code 3\)"):
        runner.submit("exit").result()
    assert runner.submit(1).result() == 2  # a fresh child
    last = runner.worker.pid
    assert last != pid and not os.path.exists(f"/proc/{pid}")
    runner.shutdown()
    assert runner.worker.pid is None and not os.path.exists(f"/proc/{last}")
