"""The agent demo's pieces: expert warm-up data and the success plot (the full demo is a script)."""

import json
from argparse import Namespace

import pytest

from grouprl.demos.agent import (
    env_title,
    expert_examples,
    plot_success,
    warmup_env_kwargs,
    write_transcripts,
)
from grouprl.envs.frozenlake import shortest_path
from grouprl.envs.tools.calls import parse_action
from grouprl.policies.text.tiny import char_tokenizer

KW = {"random_map": True, "size": 3, "frozen_prob": 0.7, "max_steps": 6, "system_prompt": "Go."}


def test_expert_examples_label_the_shortest_path_move_of_the_shown_map():
    tok = char_tokenizer()
    examples = expert_examples(
        "grouprl/FrozenLake-v0", KW, [0, 1, 2], tok, expert_p=0.5, max_turns=6
    )
    assert examples
    for ex in examples:
        assert ex["prompt"].endswith("<|assistant|>\n")  # the generation prompt the agent sees
        move = parse_action(ex["answer"]).raw
        grid = ex["prompt"].split("<|user|>\n")[-1].split("\n<|assistant|>")[0].splitlines()
        r = next(i for i, row in enumerate(grid) if "P" in row)
        path = shortest_path(grid, (r, grid[r].index("P")))  # P reads as frozen ice there
        assert path is not None and move == path[0]


def test_plot_and_transcripts_from_run_dirs(tmp_path):
    for label in ("a", "b"):
        d = tmp_path / label
        d.mkdir()
        rows = [{"step": s, "split": "eval", "eval/accuracy": 0.1 * s, "eval/sampled_success": 0.05 * s}
                for s in (0, 2)] + [{"step": s, "split": "train", "episode/success": 0.5}
                                    for s in (1, 2)]  # fmt: skip
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        (d / "samples.jsonl").write_text(json.dumps({"step": 2, "transcript": f"### {label}"}))
    dirs = {"A": tmp_path / "a", "B": tmp_path / "b"}
    plot_success(dirs, tmp_path / "s.png", "title")
    write_transcripts(dirs, tmp_path / "t.md")
    assert (tmp_path / "s.png").stat().st_size > 10_000
    text = (tmp_path / "t.md").read_text()
    assert "## A (step 2)" in text and "### b" in text


def test_warm_up_reads_random_maps_of_the_rl_maps_size_unless_told_same():
    rl = {"map_name": "4x4", "max_steps": 8, "system_prompt": "Go."}
    random = warmup_env_kwargs(rl, Namespace(warmup_maps="random", warmup_frozen_prob=0.8))
    assert random == {**rl, "random_map": True, "frozen_prob": 0.8, "size": 4}
    assert warmup_env_kwargs(rl, Namespace(warmup_maps="same", warmup_frozen_prob=0.8)) == rl
    assert env_title(rl) == "gymnasium's 4x4 map"
    assert env_title(KW) == "random 3x3 maps"


def _sampled(out: str, label: str) -> tuple[float, float]:
    """(first, last) sampled evaluation success printed for a run, in percent."""
    line = next(x for x in out.splitlines() if x.startswith(f"{label}: eval success (sampled)"))
    first, last = line.split(")")[1].replace("%", "").split("->")
    return float(first), float(last)


def test_demo_runs_end_to_end_in_small(tmp_path, capsys):
    """The whole demo on a tiny budget: warm-up, both runs in subprocesses, PNG, transcripts."""
    from grouprl.demos import agent as agent_demo

    code = agent_demo.main([
        "--warmup-episodes", "8", "--warmup-steps", "2", f"run.output_dir={tmp_path}",
        "train.steps=2", "eval.every=2", "eval.pass_k=2", "task.options.n_eval=1",
        "rollout.prompts_per_step=1", "rollout.group_size=2",
    ])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    for label in ("GiGPO", "GRPO"):
        first, last = _sampled(out, label)
        assert 0 <= first <= 100 and 0 <= last <= 100
        assert (tmp_path / f"frozenlake-{label.lower()}" / "metrics.jsonl").exists()
    assert (tmp_path / "frozenlake_success.png").stat().st_size > 10_000
    transcripts = (tmp_path / "frozenlake_transcripts.md").read_text()
    assert "## GiGPO (step 2)" in transcripts and "## GRPO (step 2)" in transcripts


@pytest.mark.slow
def test_demo_raises_sampled_success(tmp_path, capsys):
    """The real demo (about 7 minutes on 2 cores): both runs raise sampled success by 40+ points."""
    from grouprl.demos import agent as agent_demo

    assert agent_demo.main([f"run.output_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    for label in ("GiGPO", "GRPO"):
        first, last = _sampled(out, label)
        assert last >= first + 40, (label, first, last)
