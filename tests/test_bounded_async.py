"""train.async_mode bounded: staleness-bounded asynchronous training with partial rollouts
(grouprl/runtime/bounded_async.py, rollouts/staleness.py, policies/text/engines/partial.py).

- max_staleness 0 reproduces the synchronous run bit for bit (the producer samples on demand).
- The staleness accounting drops / down-weights exactly the hand-computed tokens and samples.
- A completion cut at a chunk boundary keeps the log-prob and the version that sampled each token,
  and equals one straight generation when the weights did not change.
- A checkpoint sees the sampler before the oldest batch not yet trained; a run resumes.
- Combinations that cannot work are refused with the option's name.
"""

from __future__ import annotations

import copy
import json
import math
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from test_async_rollout import Sampler

from grouprl.config.loading import apply_overrides, validate
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.policies.text.engines.fast import FastEngine
from grouprl.policies.text.engines.hf import HFEngine
from grouprl.policies.text.engines.partial import ChunkedEngine
from grouprl.rollouts.batching import recompute_old, single_pass
from grouprl.rollouts.staleness import apply_bound
from grouprl.runtime.async_rollout import check_async
from grouprl.runtime.bounded_async import BoundedAsync
from grouprl.runtime.checkpoint import CheckpointManager
from grouprl.runtime.trainer_state import read_state
from grouprl.train import train
from grouprl.types import Rollout

BOUNDED = ["train.async_mode=bounded", "algorithm.engine_correction=token_truncate"]


REWARDS_PY = """
def parity(completions, **_):
    return [float(sum(map(ord, c)) % 2) for c in completions]
"""


def make_cfg(out_dir, model_dir, *overrides, name="run"):
    reward_file = out_dir / "rewards.py"
    out_dir.mkdir(parents=True, exist_ok=True)
    reward_file.write_text(REWARDS_PY)
    raw = {
        "rewards": [{"name": "accuracy"}, {"name": f"{reward_file}:parity"}],
        "workload": {"type": "text"},
        "run": {"name": name, "output_dir": str(out_dir), "device": "cpu", "console": False,
                "seed": 0},
        "model": {"name_or_path": str(model_dir)},
        "task": {"name": "arithmetic",
                 "options": {"n_train": 16, "n_eval": 2, "ops": "+", "max_value": 9}},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6},
        "train": {"steps": 3, "lr": 1e-3},
    }  # fmt: skip
    return validate(apply_overrides(raw, list(overrides)))


def rows_of(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "train"]


def final(run_dir):
    return load_file(CheckpointManager(run_dir).latest() / "model" / "model.safetensors")


def checkpoint_state(run_dir, step):
    return read_state(run_dir / f"checkpoints/step-{step:08d}")


# ---- k = 0 is the synchronous run -----------------------------------------------------------------


def test_max_staleness_zero_reproduces_the_synchronous_run_exactly(tiny_model_dir, tmp_path):
    sync = train(make_cfg(tmp_path, tiny_model_dir, name="sync"))
    bounded = train(make_cfg(tmp_path, tiny_model_dir, "train.async_mode=bounded",
                             "train.max_staleness=0", name="k0"))  # fmt: skip
    a, b = final(sync["run_dir"]), final(bounded["run_dir"])
    w0 = load_file(tiny_model_dir / "model.safetensors")
    assert max(float((a[k] - w0[k]).abs().max()) for k in a) > 1e-3  # training moved them
    assert all(torch.equal(a[k], b[k]) for k in a)  # global seeding: the same RNG draws too
    for r, s in zip(rows_of(tmp_path / "sync"), rows_of(tmp_path / "k0"), strict=True):
        assert (r["loss"], r["reward/mean"], r["grad_norm"]) == (
            s["loss"], s["reward/mean"], s["grad_norm"],
        )  # fmt: skip
        assert s["async/staleness_max"] == 0 and s["async/staleness_hist/0"] == 1.0
        assert s["async/dropped_samples"] == 0


# ---- the staleness accounting, by hand ------------------------------------------------------------


def crafted():
    # trained with version 5, k = 1; row 0: versions 5 5 4 (max staleness 1), row 1: 4 3 3
    # (2), row 2: 5 2 and padding (3), row 3: 5 and padding -1 (0)
    version = torch.tensor([[5, 5, 4], [4, 3, 3], [5, 2, -1], [5, -1, -1]])
    mask = version >= 0
    return version, mask


def test_drop_removes_samples_with_a_token_beyond_the_bound():
    version, mask = crafted()
    keep, weights, m = apply_bound(version, mask, 5, 1, "drop", 0.5)
    assert keep.tolist() == [True, False, False, True] and weights is None
    assert m["async/dropped_samples"] == 2
    # trained tokens: row 0 (0, 0, 1), row 3 (0): 4 tokens, staleness 0 0 1 0
    assert m["async/staleness_mean"] == pytest.approx(0.25)
    assert m["async/staleness_max"] == 1
    assert (m["async/staleness_hist/0"], m["async/staleness_hist/1"]) == (0.75, 0.25)


def test_downweight_keeps_every_sample_and_decays_tokens_beyond_the_bound():
    version, mask = crafted()
    keep, weights, m = apply_bound(version, mask, 5, 1, "downweight", 0.5)
    assert keep.all() and m["async/dropped_samples"] == 0
    # staleness:  row 0: 0 0 1 -> 1 1 1;  row 1: 1 2 2 -> 1 .5 .5;  row 2: 0 3 pad -> 1 .25 1
    expected = torch.tensor([[1, 1, 1], [1, 0.5, 0.5], [1, 0.25, 1], [1, 1, 1.0]])
    torch.testing.assert_close(weights, expected, rtol=0, atol=0)
    # 9 trained tokens: staleness 0 x4 (rows 0, 2, 3), 1 x2, 2 x2, 3 x1
    assert m["async/staleness_mean"] == pytest.approx((0 * 4 + 1 * 2 + 2 * 2 + 3) / 9)
    assert m["async/staleness_max"] == 3
    assert m["async/staleness_hist/2"] == pytest.approx(2 / 9)


def test_a_token_newer_than_the_trained_weights_is_an_error():
    version, mask = crafted()
    with pytest.raises(ValueError, match="newer than the weights"):
        apply_bound(version, mask, 4, 1, "drop", 0.5)


# ---- the producer with crafted batches ------------------------------------------------------------


def source_of(policy, make, *, k=1, prefetch=None, stale="drop", steps=4, chunk=None):
    cfg = SimpleNamespace(train=SimpleNamespace(
        max_staleness=k, async_prefetch=prefetch, stale_policy=stale, stale_decay=0.5,
        steps=steps, partial_chunk_tokens=chunk))  # fmt: skip
    sampler = Sampler()
    return BoundedAsync(cfg, policy, sampler, lambda i, pol: make(i, pol, sampler)), sampler


def batch_of(versions):
    v = torch.tensor(versions)  # [N, T]
    n = v.shape[0]
    return Rollout(group_ids=torch.arange(n), rewards={}, actions=None,
                   old_logp=torch.zeros(v.shape), mask=v >= 0, token_version=v)  # fmt: skip


@pytest.mark.parametrize("stale", ["drop", "downweight"])
def test_the_trainer_drops_or_downweights_a_crafted_queue(tiny_model, tiny_tokenizer, stale):
    policy = CausalLMPolicy(tiny_model, tiny_tokenizer)
    # k = 0, prefetch 3: batches 0..3 are made at once; batch 1 is trained at version 1, its
    # row 1 holds a token of version 0 (1 version beyond the bound)
    crafted_batches = {0: [[0, 0], [0, 0]], 1: [[1, 1], [0, 1]], 2: [[2, 2]], 3: [[3, 3]]}
    made = []

    def make(index, pol, sampler):
        sampler.position += 1
        made.append(index)
        return batch_of(crafted_batches[index]), {}

    source, sampler = source_of(policy, make, k=0, prefetch=3, stale=stale, steps=4)
    r0, m0 = source.next(0, policy)  # version 0: batch 0 fresh
    assert len(r0) == 2 and m0["async/dropped_samples"] == 0
    deadline = time.monotonic() + 10
    while len(made) < 4 and time.monotonic() < deadline:  # made ahead of the demand
        time.sleep(0.01)
    assert made == [0, 1, 2, 3]
    r1, m1 = source.next(1, policy)  # version 1
    source.after_prepare(r1)
    if stale == "drop":
        assert len(r1) == 1 and r1.token_version.tolist() == [[1, 1]]
        assert m1["async/dropped_samples"] == 1 and r1.token_scales is None
        assert m1["async/staleness_hist/0"] == 1.0
    else:
        assert len(r1) == 2 and m1["async/dropped_samples"] == 0
        assert r1.token_scales.tolist() == [[1.0, 1.0], [0.5, 1.0]]  # decay 0.5 ** (1 - 0)
        assert m1["async/staleness_mean"] == pytest.approx(0.25)
        assert m1["async/staleness_hist/1"] == pytest.approx(0.25)
    source.close()
    assert sampler.position == 4


def test_a_whole_batch_beyond_the_bound_is_dropped_and_the_next_taken(tiny_model, tiny_tokenizer):
    policy = CausalLMPolicy(tiny_model, tiny_tokenizer)
    versions = {0: [[0, 0]], 1: [[0, 0], [0, -1]], 2: [[1, 1]]}  # at step 2 (version 2)

    def make(index, pol, sampler):
        sampler.position += 1
        return batch_of(versions[index] if index < 3 else [[2, 2]]), {}

    source, sampler = source_of(policy, make, k=0, prefetch=0, stale="drop", steps=3)
    source.next(0, policy)
    rollout, m = source.next(1, policy)  # version 1: batch 1's samples are 1 version old, k = 0
    assert m["async/dropped_samples"] == 2  # batch 1 dropped whole, batch 2 trained instead
    assert rollout.token_version.tolist() == [[1, 1]] and m["async/staleness_max"] == 0
    source.close()
    assert sampler.position == 3


def test_a_checkpoint_sees_the_sampler_before_the_oldest_untaken_batch(tiny_model, tiny_tokenizer):
    policy = CausalLMPolicy(tiny_model, tiny_tokenizer)
    gate = threading.Event()

    def make(index, pol, sampler):
        sampler.position += 10  # this batch's draws
        if index > 0:
            gate.wait(5)
        return batch_of([[0, 0]] if index == 0 else [[index - 1, index - 1]]), {}

    source, sampler = source_of(policy, make, k=2, steps=5)
    source.next(0, policy)  # batch 0 taken; batches 1 (in progress), then 2 ahead
    deadline = time.monotonic() + 10
    while sampler.position < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert sampler.position == 20  # the producer drew batch 1 and waits inside it
    assert source.saved_sampler(sampler).state_dict() == {"position": 10}
    gate.set()
    while sampler.position < 30 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert source.saved_sampler(sampler).state_dict() == {"position": 10}  # 1 and 2 queued
    source.next(1, policy)
    assert source.saved_sampler(sampler).state_dict()["position"] == 20
    source.close()


def test_generation_overlaps_the_update(tiny_model, tiny_tokenizer):
    policy = CausalLMPolicy(tiny_model, tiny_tokenizer)

    def make(index, pol, sampler):
        assert threading.current_thread().name == "grouprl-rollout"  # never the trainer's thread
        time.sleep(0.3)
        rollout = batch_of([[0]])
        rollout.token_version = None  # the producer stamps the version it sampled with
        return rollout, {}

    def run(k):
        source, _ = source_of(policy, make, k=k, steps=5)
        start, stale = time.perf_counter(), []
        for step in range(5):
            _, metrics = source.next(step, policy)
            stale.append(metrics["async/staleness_max"])
            time.sleep(0.3)  # the update
        source.close()
        assert max(stale) <= k
        return time.perf_counter() - start

    overlapped, serial = run(1), run(0)
    # serial: 5 x (0.3 + 0.3) = 3.0 s; overlapped: about 0.3 + 5 x 0.3 = 1.8 s (sleeps)
    assert overlapped < 0.85 * serial, (overlapped, serial)


def test_a_producer_error_surfaces_at_the_next_step(tiny_model, tiny_tokenizer):
    policy = CausalLMPolicy(tiny_model, tiny_tokenizer)

    def make(index, pol, sampler):
        if index == 1:
            raise RuntimeError("reward server down")
        return batch_of([[0]]), {}

    source, _ = source_of(policy, make, k=1)
    source.next(0, policy)
    with pytest.raises(RuntimeError, match="producer failed") as info:
        source.next(1, policy)
    assert "reward server down" in str(info.value.__cause__)
    source.close()


# ---- partial rollouts --------------------------------------------------------------------------------


def straight_and_chunked(model, tokenizer, refresh, chunk=2, n_new=6, engine_class=HFEngine):
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in ("1+2=", "4+4=", "7+1=")]
    params = SamplingParams(max_new_tokens=n_new)
    straight = engine_class(copy.deepcopy(model), tokenizer).generate(prompts, params, greedy=True)
    engine = engine_class(model, tokenizer)
    chunked = ChunkedEngine(engine, chunk, refresh).generate(prompts, params, greedy=True)
    return prompts, straight, chunked


@pytest.mark.parametrize("engine_class", [HFEngine, FastEngine])
def test_chunks_with_unchanged_weights_equal_one_straight_generation(
    tiny_model, tiny_tokenizer, engine_class
):
    calls = []

    def refresh():
        calls.append(1)
        return 7

    _, straight, chunked = straight_and_chunked(
        tiny_model, tiny_tokenizer, refresh, engine_class=engine_class
    )
    assert chunked.completion_ids == straight.completion_ids
    assert chunked.truncated == straight.truncated
    for a, b in zip(chunked.logprobs, straight.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
    assert all(
        v == [7] * len(ids) for v, ids in zip(chunked.token_versions, chunked.completion_ids)
    )
    longest = max(len(c) for c in straight.completion_ids)
    assert len(calls) == math.ceil(longest / 2)  # one refresh per chunk


def test_new_weights_between_chunks_continue_the_completion(tiny_model, tiny_tokenizer):
    old = copy.deepcopy(tiny_model)
    new = copy.deepcopy(tiny_model)
    with torch.no_grad():
        torch.manual_seed(1)
        for p in new.parameters():
            p.add_(0.3 * torch.randn_like(p))
    state = {"version": -1}

    def refresh():  # chunk 0 with the old weights, every later chunk with the new
        state["version"] += 1
        if state["version"] == 1:
            tiny_model.load_state_dict(new.state_dict())
        return min(state["version"], 1)

    prompts, straight, chunked = straight_and_chunked(tiny_model, tiny_tokenizer, refresh)
    cut = [i for i, c in enumerate(chunked.completion_ids) if len(c) > 2]
    assert cut, "no completion reached the chunk boundary"
    for i in range(len(prompts)):
        ids, vers = chunked.completion_ids[i], chunked.token_versions[i]
        assert vers == [0] * min(2, len(ids)) + [1] * max(0, len(ids) - 2)
        assert ids[:2] == straight.completion_ids[i][:2]  # chunk 0: the old weights' tokens
    # each token's log-prob is the score of the weights that sampled it (greedy: temperature 1)
    for i in cut:
        ids = chunked.completion_ids[i]
        seq = torch.tensor([prompts[i] + ids])
        logps = []
        for model in (old, new):
            with torch.no_grad():
                logits = model(seq).logits[0, len(prompts[i]) - 1 : -1]  # [T, V]
            logps.append(
                torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
            )
        expected = torch.cat([logps[0][:2], logps[1][2:]])
        torch.testing.assert_close(torch.tensor(chunked.logprobs[i]), expected, rtol=0, atol=1e-4)


def test_partial_rollouts_in_the_policy_fill_token_version(tiny_model, tiny_tokenizer):
    policy = CausalLMPolicy(tiny_model, tiny_tokenizer)
    versions = iter(range(100))
    policy.chunk_generation(2, lambda: next(versions))
    rollout = policy.sample(["1+2=", "3+3="], 2, SamplingParams(max_new_tokens=5))
    tv, mask = rollout.token_version, rollout.mask  # [N, T]
    assert tv.dtype == torch.long and tv.shape == mask.shape
    assert bool((tv[~mask] == -1).all())
    for row in range(len(rollout)):
        n = int(mask[row].sum())
        assert tv[row, :n].tolist() == [t // 2 for t in range(n)]  # chunk index per token


# ---- in the loop -------------------------------------------------------------------------------------


def test_bounded_trains_with_partial_rollouts_and_logs_staleness(tiny_model_dir, tmp_path):
    cfg = make_cfg(tmp_path, tiny_model_dir, *BOUNDED, "train.max_staleness=1",
                   "train.partial_chunk_tokens=2", "rollout.seeding=per_sample",
                   "train.steps=4")  # fmt: skip
    train(cfg)
    rows = rows_of(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert 0 <= r["async/staleness_mean"] <= r["async/staleness_max"] <= 1
        hist = {k: v for k, v in r.items() if k.startswith("async/staleness_hist/")}
        assert sum(hist.values()) == pytest.approx(1.0)
        assert r["async/dropped_samples"] == 0 and math.isfinite(r["loss"])
    assert rows[0]["async/staleness_max"] == 0  # batch 0: the weights it trains


@pytest.mark.parametrize("stale", ["drop", "downweight"])
def test_a_producer_ahead_of_the_bound_is_held_to_it_in_the_loop(tiny_model_dir, tmp_path, stale):
    """async_prefetch 2 > max_staleness 0: batches sampled ahead are dropped / down-weighted."""
    extra = ["train.stale_decay=0.5"] if stale == "downweight" else []
    train(make_cfg(tmp_path, tiny_model_dir, *BOUNDED, "train.max_staleness=0",
                   "train.async_prefetch=2", f"train.stale_policy={stale}",
                   "rollout.seeding=per_sample", "train.steps=4", *extra))  # fmt: skip
    rows = rows_of(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in rows)
    if stale == "drop":  # whatever the producer made ahead, only fresh tokens are trained
        assert all(r["async/staleness_max"] == 0 for r in rows)
    else:
        assert all(r["async/dropped_samples"] == 0 for r in rows)


def test_bounded_checkpoint_and_resume(tiny_model_dir, tmp_path):
    common = [*BOUNDED, "train.max_staleness=1", "rollout.seeding=per_sample",
              "checkpoint.every=1"]  # fmt: skip
    train(make_cfg(tmp_path / "full", tiny_model_dir, *common, "train.steps=3"))
    train(make_cfg(tmp_path / "part", tiny_model_dir, *common, "train.steps=2"))
    # the full run's step-2 checkpoint was written while batch 2 was being sampled (or queued):
    # its sampler is the one of a run that stopped after step 2
    full = checkpoint_state(tmp_path / "full/run", 2)["sampler"]
    part = checkpoint_state(tmp_path / "part/run", 2)["sampler"]
    assert full == part
    train(make_cfg(tmp_path / "part", tiny_model_dir, *common, "train.steps=3",
                   "run.resume=true"))  # fmt: skip
    assert [r["step"] for r in rows_of(tmp_path / "part/run")] == [1, 2, 3]


# ---- configuration -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.max_staleness=2"], "apply.*only to train.async_mode bounded"),
        (["train.async_mode=one_step_off", "train.partial_chunk_tokens=4"], "partial_chunk_tokens"),
        (["train.async_mode=bounded", "train.async_staleness=0"], "train.max_staleness"),
        ([*BOUNDED, "train.stale_decay=0.3"], "stale_policy downweight"),
        (["train.async_mode=bounded"], "algorithm.engine_correction"),
        (
            ["train.async_mode=bounded", "train.max_staleness=0", "train.async_prefetch=1"],
            "algorithm.engine_correction",
        ),
        ([*BOUNDED, "train.partial_chunk_tokens=2", "rollout.stop=['.']"], "stop"),
        ([*BOUNDED, "train.max_staleness=-1"], "max_staleness"),
    ],
)
def test_bad_bounded_configs_are_refused(tiny_model_dir, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_cfg(tmp_path, tiny_model_dir, *overrides)


def test_bounded_refusals_at_start(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="async_worker 'process'"):
        check_async(make_cfg(tmp_path, tiny_model_dir, *BOUNDED, "train.async_worker=process"), 1)
    with pytest.raises(ValueError, match="vllm"):
        check_async(make_cfg(tmp_path, tiny_model_dir, *BOUNDED, "rollout.engine=vllm"), 1)
    with pytest.raises(ValueError, match="several processes"):
        check_async(make_cfg(tmp_path, tiny_model_dir, *BOUNDED), 2)
    ok = make_cfg(tmp_path, tiny_model_dir, "train.async_mode=bounded", "rollout.old_logp=engine")
    check_async(ok, 1)  # coupled PPO: the clip around the behaviour policy, no correction needed


def test_bounded_scores_the_proximal_policy_with_the_current_weights(tiny_model_dir, tmp_path):
    one = make_cfg(tmp_path, tiny_model_dir, *BOUNDED)
    assert single_pass(one)  # 1 epoch, 1 minibatch: the update's own forward is pi_prox
    two = make_cfg(tmp_path, tiny_model_dir, *BOUNDED, "algorithm.epochs=2")
    assert recompute_old(two) and not single_pass(two)  # prepare scores pi_prox
