"""rollout.hooks: hints for all-fail groups and replay of past successes (grouprl/rollouts/hooks/).

Hand-made batches pin what each hook does to the rows; a real tiny Qwen2 pins the forced response
start (its tokens attended and rewarded, never trained); short runs pin the loop, the checkpoint
round trip of the replay buffer and the config errors.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from grouprl.config.hooks import HintHookConfig, ReplayHookConfig
from grouprl.config.loading import apply_overrides, validate
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.rollouts.filters import failed_groups, splice_rows
from grouprl.rollouts.hooks import HookContext, SignalHooks
from grouprl.rollouts.hooks.hint import HintHook, solution_prefix, with_prompt_hint
from grouprl.rollouts.hooks.replay import ReplayHook
from grouprl.runtime.trainer_state import read_state, write_state
from grouprl.train import train
from grouprl.types import ROW_HINTED, ROW_REPLAYED, ROW_SAMPLED, Rollout, TokenBatch

sys.path.insert(0, str(Path(__file__).parent))
from test_methods_train import make_cfg, train_rows  # noqa: E402

NAN = math.nan


def batch_of(group_ids, rewards, prompts=None, completions=None):
    """A text batch: prompt ids [N, 2], completion ids [N, 3] (row i: 10i, 10i+1, 10i+2), sampling
    log-probs -0.1 * (i + 1) per token."""
    n = len(group_ids)
    prompts = prompts or [f"p{g}" for g in group_ids]
    ids = torch.tensor([[10 * i, 10 * i + 1, 10 * i + 2] for i in range(n)])  # [N, 3]
    logp = torch.tensor([[-0.1 * (i + 1)] * 3 for i in range(n)])  # [N, 3]
    return Rollout(
        group_ids=torch.tensor(group_ids),
        rewards={"accuracy": torch.tensor(rewards, dtype=torch.float32)},
        actions=TokenBatch(
            prompt_ids=torch.tensor([[1, 100 + g] for g in group_ids]),
            prompt_mask=torch.ones(n, 2, dtype=torch.bool),
            completion_ids=ids,
            completion_mask=torch.ones(n, 3, dtype=torch.bool),
            truncated=torch.zeros(n, dtype=torch.bool),
        ),
        old_logp=logp.clone(),
        mask=torch.ones(n, 3, dtype=torch.bool),
        engine_logp=logp,
        examples=[{"prompt": p, "answer": "42"} for p in prompts],
        row_source=torch.zeros(n, dtype=torch.long),
        info={"prompt": list(prompts),
              "completion": completions or [f"c{i}" for i in range(n)],
              "completion_ids": ids.tolist()},
    )  # fmt: skip


def no_resample(*_):
    raise AssertionError("replay never samples")


# ---- the pure parts --------------------------------------------------------------------------


def test_solution_prefix_counts_units_by_ceiling():
    assert solution_prefix("so x = 4 and y = 2", 0.25, "words") == "so x "  # ceil(0.25 * 8) = 2
    assert solution_prefix("so x = 4 and y = 2", 1.0, "words") == "so x = 4 and y = 2"
    assert solution_prefix("82", 0.5, "characters") == "8"
    assert solution_prefix("82", 0.3, "characters") == "8"  # ceil(0.6) = 1
    assert solution_prefix("1234", 0.5, "characters") == "12"  # exactly 2, not 3
    assert solution_prefix("82", 0.0, "characters") == ""
    assert solution_prefix("", 1.0, "words") == ""


def test_hint_fraction_anneals_linearly_then_stays():
    hook = HintHook(HintHookConfig(start_fraction=0.8, end_fraction=0.2, anneal_steps=4))
    assert [hook.fraction(s) for s in (0, 1, 2, 4, 9)] == pytest.approx([0.8, 0.65, 0.5, 0.2, 0.2])


def test_prompt_hint_goes_after_the_prompt_or_into_the_last_user_message():
    assert with_prompt_hint("2+2=", "4", " ({hint})") == "2+2= (4)"
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]  # fmt: skip
    out = with_prompt_hint(chat, "  h ", "\nHint: {hint}")
    assert out[3]["content"] == "q2\nHint: h" and out[1]["content"] == "q"
    assert chat[3]["content"] == "q2"  # the example's own prompt is not edited
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]}]
    assert with_prompt_hint(parts, "h", "+{hint}")[0]["content"][-1] == {
        "type": "text",
        "text": "+h",
    }
    with pytest.raises(ValueError, match="without a user message"):
        with_prompt_hint([{"role": "system", "content": "s"}], "h", "{hint}")


def test_failed_groups_are_the_groups_where_no_valid_sample_passes():
    reward = torch.tensor([0.0, 0.0, 1.0, 0.0, NAN, 0.0, NAN, NAN, 0.5, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    # group 2: one valid failing sample; group 3: no valid sample (a hint cannot help)
    assert failed_groups(reward, groups, 1.0) == [0, 2, 4]
    assert failed_groups(reward, groups, 0.5) == [0, 2]


def test_splice_keeps_groups_contiguous_in_batch_order():
    r = batch_of([5, 5, 7, 7], [0, 0, 0, 0])
    extra = batch_of([7, 5], [1, 1]).select([0, 1])
    out = splice_rows(r, torch.tensor([True, False, True, True]), extra)
    assert out.group_ids.tolist() == [5, 5, 7, 7, 7]
    # group 5: its kept row 0, then extra row 1; group 7: rows 2, 3, then extra row 0
    assert out.actions.completion_ids[:, 0].tolist() == [0, 10, 20, 30, 0]
    with pytest.raises(ValueError, match="not in the batch"):
        splice_rows(r, torch.ones(4, dtype=torch.bool), batch_of([9], [1]))


# ---- replay --------------------------------------------------------------------------------------


def test_replay_stores_successes_and_fills_an_all_fail_group_later():
    hook = ReplayHook(ReplayHookConfig(per_group=2, per_prompt=3))
    ctx = HookContext(step=0, weights={"accuracy": 1.0}, resample=no_resample)
    first = batch_of([0, 0, 0, 1, 1, 1], [1, 0, 1, 0, 0, 0], prompts=["A"] * 3 + ["B"] * 3)
    out = hook.apply(first, ctx)
    assert out is first  # nothing stored yet for B; A's group is informative
    assert [e["ids"] for e in hook.buffer["A"]] == [[0, 1, 2], [20, 21, 22]]
    assert hook.buffer["A"][1]["logp"] == pytest.approx([-0.3] * 3)
    # step 3: A fails everywhere -> its last 2 rows are replaced by the 2 newest successes
    later = batch_of([4, 4, 4], [0, 0, 0], prompts=["A"] * 3)
    out = hook.apply(later, HookContext(3, {"accuracy": 1.0}, no_resample))
    assert out.group_ids.tolist() == [4, 4, 4]
    assert out.row_source.tolist() == [ROW_SAMPLED, ROW_REPLAYED, ROW_REPLAYED]
    assert out.rewards["accuracy"].tolist() == [0.0, 1.0, 1.0]
    assert out.actions.completion_ids[1:].tolist() == [[0, 1, 2], [20, 21, 22]]
    assert out.engine_logp[1:, 0].tolist() == pytest.approx([-0.1, -0.3])  # behaviour log-probs
    assert out.actions.prompt_ids[1:].tolist() == [[1, 104], [1, 104]]  # the group's prompt
    assert out.info["completion"] == ["c0", "c0", "c2"]
    m = hook.metrics()
    assert (m["groups"], m["rows"], m["stored"], m["buffer_successes"]) == (1, 2, 2, 2)


def test_replay_keeps_one_sampled_row_and_never_stores_replayed_rows():
    hook = ReplayHook(ReplayHookConfig(per_group=4, per_prompt=4))
    ctx = HookContext(0, {"accuracy": 1.0}, no_resample)
    hook.apply(batch_of([0, 0, 0], [1, 1, 1], prompts=["A"] * 3), ctx)
    out = hook.apply(batch_of([1, 1, 1], [0, 0, 0], prompts=["A"] * 3), ctx)
    assert out.row_source.tolist() == [ROW_SAMPLED, ROW_REPLAYED, ROW_REPLAYED]  # G - 1 at most
    before = [e["ids"] for e in hook.buffer["A"]]
    hook.apply(out, ctx)  # the replayed successes are in the batch again: not stored twice
    assert [e["ids"] for e in hook.buffer["A"]] == before


def test_replay_eviction_capacity_and_age():
    oldest = ReplayHook(ReplayHookConfig(per_group=1, per_prompt=2, capacity=2, max_age=2))
    for step, prompt in enumerate(["A", "A", "A", "B", "A", "C"]):
        r = batch_of([step], [1.0], prompts=[prompt], completions=[f"s{step}"])
        r.actions.completion_ids += 100 * step  # distinct completions
        oldest.apply(r, HookContext(step, {"accuracy": 1.0}, no_resample))
        if step == 2:  # per_prompt 2: the step-0 success of A left for the step-2 one
            assert [e["step"] for e in oldest.buffer["A"]] == [1, 2]
    assert list(oldest.buffer) == ["A", "C"]  # capacity 2: B was seen least recently
    assert [e["step"] for e in oldest.buffer["A"]] == [2, 4]
    assert [e["step"] for e in oldest.live("A", 5)] == [4]  # age 5 - 2 > 2: dropped
    assert oldest.live("C", 8) == [] and "C" not in oldest.buffer  # age 8 - 5 > 2: dropped
    best = ReplayHook(ReplayHookConfig(per_prompt=2, eviction="lowest_reward"))
    for step, reward in enumerate([3.0, 1.0, 2.0]):
        r = batch_of([step], [reward], prompts=["A"])
        r.actions.completion_ids += 100 * step  # distinct completions
        best.apply(r, HookContext(step, {"accuracy": 1.0}, no_resample))
    assert sorted(e["reward"] for e in best.buffer["A"]) == [2.0, 3.0]


def test_replay_buffer_round_trips_through_the_checkpoint_format(tmp_path):
    hooks = SignalHooks([ReplayHookConfig()])
    r = batch_of([0, 0, 1], [1.0, 0.0, 1.0], prompts=["A", "A", "B"])
    r.rewards["fmt"] = torch.tensor([NAN, 0.25, 1.0])
    r.engine_logp[0, 1] = -1.0 / 3.0  # a float32 value with no short decimal form
    hooks.apply(r, HookContext(0, {"accuracy": 1.0, "fmt": 0.0}, no_resample))
    write_state({"rollout_hooks": hooks.state_dict()}, tmp_path)
    back = SignalHooks([ReplayHookConfig()])
    back.load_state_dict(read_state(tmp_path)["rollout_hooks"])
    assert back.state_dict() == hooks.state_dict()
    assert back.hooks[0].buffer["A"][0]["rewards"] == {"accuracy": 1.0, "fmt": None}
    assert json.dumps(hooks.state_dict())  # plain JSON values only


# ---- hint --------------------------------------------------------------------------------------


def test_hint_resamples_all_but_keep_sampled_rows_of_each_failed_group():
    cfg = HintHookConfig(column="answer", where="prompt", template=" [{hint}]", unit="characters",
                         start_fraction=0.5, end_fraction=0.5)  # fmt: skip
    calls = []

    def resample(examples, prefixes, size):
        calls.append(([e["prompt"] for e in examples], prefixes, size))
        n = len(examples) * size
        groups = [900 + k for k in range(len(examples)) for _ in range(size)]
        out = batch_of(groups, [1.0, 0.0] * (n // 2), prompts=[e["prompt"] for e in examples
                                                               for _ in range(size)])  # fmt: skip
        out.actions.completion_ids += 1000
        return out

    r = batch_of([3, 3, 3, 4, 4, 4], [0, 0, 0, 1, 0, 0], prompts=["x"] * 3 + ["y"] * 3)
    out = HintHook(cfg).apply(r, HookContext(0, {"accuracy": 1.0}, resample))
    assert calls == [(["x [4]"], None, 2)]  # G - keep_sampled = 2 rows with half of "42"
    assert out.group_ids.tolist() == [3, 3, 3, 4, 4, 4]
    assert out.row_source.tolist() == [0, 1, 1, 0, 0, 0]
    assert out.actions.completion_ids[:3, 0].tolist() == [0, 1000, 1010]
    assert out.rewards["accuracy"][:3].tolist() == [0.0, 1.0, 0.0]


def test_hint_context_original_trains_on_the_original_prompt():
    cfg = HintHookConfig(column="answer", where="prompt", context="original", keep_sampled=0)

    def resample(examples, prefixes, size):
        out = batch_of([50] * size, [1.0] * size, prompts=[examples[0]["prompt"]] * size)
        out.actions.prompt_ids = torch.tensor([[7, 7]] * size)  # the hinted prompt's ids
        return out

    r = batch_of([3, 3], [0, 0], prompts=["x", "x"])
    out = HintHook(cfg).apply(r, HookContext(0, {"accuracy": 1.0}, resample))
    assert out.row_source.tolist() == [ROW_HINTED, ROW_HINTED]
    assert out.actions.prompt_ids.tolist() == [[1, 103], [1, 103]]  # the group's own prompt
    assert out.info["prompt"] == ["x", "x"] and out.examples[0]["prompt"] == "x"
    assert out.engine_logp[:, 0].tolist() == pytest.approx([-0.1, -0.2])  # hinted behaviour


def test_hint_missing_column_names_it():
    hook = HintHook(HintHookConfig(column="solution"))
    r = batch_of([0, 0], [0, 0])
    with pytest.raises(ValueError, match="'solution'.*\\['answer', 'prompt'\\]"):
        hook.apply(r, HookContext(0, {"accuracy": 1.0}, no_resample))


def test_forced_response_start_is_attended_and_rewarded_but_not_trained(tiny_model_dir):
    policy = CausalLMPolicy.from_pretrained(tiny_model_dir, dtype="float32", engine="fast")
    params = SamplingParams(temperature=1.0, max_new_tokens=3)
    torch.manual_seed(0)
    out = policy.sample(["1+2=", "3+4="], 2, params, response_prefixes=["12", ""])
    hint = policy.tokenizer.encode("12", add_special_tokens=False)
    ids, mask = out.actions.completion_ids, out.mask  # [4, T]
    for row in (0, 1):
        assert ids[row, :2].tolist() == hint
        assert out.info["completion"][row].startswith("12")
        assert mask[row, :2].tolist() == [False, False] and bool(mask[row, 2])
        assert out.engine_logp[row, :2].tolist() == [0.0, 0.0]
    assert bool(mask[2, 0]) and bool(out.actions.completion_mask[0, :2].all())  # attended
    # the trainer's score of the generated tokens, conditioned on the forced start, is the
    # engine's sampling log-prob
    with torch.no_grad():
        scored = policy.log_probs(out.actions, temperature=1.0).logp  # [4, T]
    assert torch.allclose(scored[mask], out.engine_logp[mask], atol=1e-4)
    with pytest.raises(ValueError, match="one text per prompt"):
        policy.sample(["1+2="], 1, params, response_prefixes=["1", "2"])


# ---- the loop -------------------------------------------------------------------------------------

HINT = ("{type: hint, text: solution_prefix, column: answer, where: response, unit: characters, "
        "start_fraction: 1.0, end_fraction: 0.5, anneal_steps: 2}")  # fmt: skip


def test_hint_runs_in_the_loop_with_its_schedule(tmp_path, tiny_model_dir):
    train(make_cfg(tmp_path, tiny_model_dir, f"rollout.hooks=[{HINT}]", "train.steps=3"))
    rows = train_rows(tmp_path / "run")
    assert [r["hooks/hint/fraction"] for r in rows] == [1.0, 0.75, 0.5]
    # the untrained model fails every problem; the whole answer as the completion's start passes
    assert rows[0]["hooks/hint/groups"] == 2 and rows[0]["hooks/hint/passed_rows"] > 0
    assert all(math.isfinite(r["loss"]) for r in rows)


REWARD = """
def low_first(completions, **_):
    return [1.0 if c and ord(c[0]) < 64 else 0.0 for c in completions]
"""


def test_replay_runs_in_the_loop_and_resumes_exactly(tmp_path, tiny_model_dir):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)  # about 1 in 4 random first characters: mixed groups
    common = ["rollout.hooks=[{type: replay, per_group: 2}]", f"rewards=[{{name: '{reward}:low_first'}}]",
              "algorithm.engine_correction=token_truncate", "run.seed=3",
              "rollout.seeding=per_sample", "checkpoint.every=1", "rollout.prompts_per_step=4",
              "task.options.n_train=4"]  # fmt: skip
    full = tmp_path / "full"
    train(make_cfg(full, tiny_model_dir, *common, "train.steps=4"))
    rows = train_rows(full / "run")
    assert rows[-1]["hooks/replay/buffer_successes"] > 0
    assert sum(r["hooks/replay/rows"] for r in rows) > 0  # some all-fail group got a success
    assert all(math.isfinite(r["loss"]) for r in rows)
    # stop after 2 steps, resume to 3: the replay buffer and the curve are the uninterrupted run's
    part = tmp_path / "part"
    train(make_cfg(part, tiny_model_dir, *common, "train.steps=2"))
    train(make_cfg(part, tiny_model_dir, *common, "train.steps=4", "run.resume=true"))
    a = read_state(full / "run/checkpoints/step-00000004")["rollout_hooks"]
    b = read_state(part / "run/checkpoints/step-00000004")["rollout_hooks"]
    assert a == b and a["replay"]["buffer"]
    assert train_rows(part / "run")[-1]["loss"] == pytest.approx(rows[-1]["loss"], abs=1e-6)


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.hooks=[{type: replay}]", "algorithm.engine_correction"),
        ("rollout.hooks=[{type: hint, context: original}]", "algorithm.engine_correction"),
        ("rollout.hooks=[{type: replay, per_group: 5, per_prompt: 2}]", "per_group=5"),
        ("rollout.hooks=[{type: hint}, {type: hint}]", "hint more than once"),
        ("rollout.hooks=[{type: nope}]", "hint"),
    ],
)
def test_hook_config_errors_name_the_option(override, message, tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match=message):
        make_cfg(tmp_path, tiny_model_dir, override)


def test_hooks_with_async_rollouts_or_another_workload_are_refused(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="async_mode"):
        make_cfg(tmp_path, tiny_model_dir, "rollout.hooks=[{type: hint}]",
                 "train.async_mode=one_step_off")  # fmt: skip
    raw = {"workload": {"type": "agent"},
           "task": {"name": "env", "options": {"env_id": "grouprl/FrozenLake-v0"}},
           "model": {"name_or_path": str(tiny_model_dir)},
           "rollout": {"hooks": [{"type": "hint"}]}}  # fmt: skip
    with pytest.raises(ValueError, match="does not support rollout.hooks"):
        validate(apply_overrides(raw, []))


def test_gsm8k_worked_solution_is_kept_for_the_hint_preset(tmp_path):
    from grouprl.envs.tasks import build_task

    rows = [{"question": f"q{i}", "answer": f"Add {i} and 2 to get {i + 2}.\n#### {i + 2}"}
            for i in range(4)]  # fmt: skip
    data = tmp_path / "gsm.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    task = build_task("math", source=str(data), answer_format="gsm8k")
    ex = task.train[0]
    assert ex["answer"] == str(int(ex["question"][1:]) + 2) and ex["solution"].startswith("Add ")
    hook = HintHook(validate({"workload": {"type": "text"}, "model": {"name_or_path": "x"},
                              "task": {"name": "arithmetic"},
                              "algorithm": {"preset": "hint"}}).rollout.hooks[0])  # fmt: skip
    words = ex["solution"].split()
    assert hook.hint_for(ex, 0).split() == words[: math.ceil(len(words) / 2)]  # half at step 0
    assert hook.hint_for(ex, 200) == ""  # annealed to nothing


def test_hooks_under_two_processes_match_one(tiny_model_dir, tmp_path):
    """Every process sees the whole gathered round, so hint re-samples (split over the processes
    like any collect) and replay's buffer come out the same as with one process."""
    import yaml
    from safetensors.torch import load_file
    from test_distributed import REWARDS_PY, launch_two, max_diff, two_process_raw

    from grouprl.runtime.checkpoint import CheckpointManager

    reward_file = tmp_path / "rewards.py"
    reward_file.write_text(REWARDS_PY)
    hooks = {"rollout": {"hooks": [
        {"type": "hint", "text": "solution_prefix", "column": "answer", "where": "response",
         "unit": "characters", "start_fraction": 1.0, "end_fraction": 1.0},
        {"type": "replay"}]}, "algorithm": {"engine_correction": "token_truncate"}}  # fmt: skip

    def raw(out):
        r = two_process_raw(out, tiny_model_dir, reward_file)
        r["rollout"] = {**r["rollout"], **hooks["rollout"]}
        return {**r, "algorithm": hooks["algorithm"]}

    config_path = tmp_path / "cfg.yaml"
    config_path.write_text(yaml.safe_dump(raw(tmp_path / "two")))
    launch_two(config_path)
    one = Path(train(validate(apply_overrides(raw(tmp_path / "one"), [])))["run_dir"])
    two = tmp_path / "two" / "r"
    a, b = CheckpointManager(one).latest(), CheckpointManager(two).latest()
    assert max_diff(load_file(a / "model/model.safetensors"),
                     load_file(b / "model/model.safetensors")) < 5e-5  # fmt: skip
    buf1, buf2 = (read_state(c)["rollout_hooks"]["replay"]["buffer"] for c in (a, b))
    assert [k for k, _ in buf1] == [k for k, _ in buf2] and buf1
    # the same successes; a row's sampling log-probs differ by float rounding with the batch the
    # engine sampled it in (each process samples its share)
    for (_, e1), (_, e2) in zip(buf1, buf2):
        assert [{k: v for k, v in e.items() if k != "logp"} for e in e1] == [
            {k: v for k, v in e.items() if k != "logp"} for e in e2
        ]
        for x, y in zip(e1, e2):
            assert x["logp"] == pytest.approx(y["logp"], abs=1e-5)
    rows1, rows2 = train_rows(one), train_rows(two)
    assert sum(r["hooks/hint/rows"] for r in rows1) > 0
    for r1, r2 in zip(rows1, rows2, strict=True):
        assert {k: v for k, v in r1.items() if k.startswith("hooks/")} == {
            k: v for k, v in r2.items() if k.startswith("hooks/")
        }
