"""Multi-turn agents: episodes in gymnasium-style text environments, tools, per-turn credit.

An action is a token of one of the agent's own turns (environment and tool tokens are masked out),
so the loss is the token loss of workloads/tokens.py. The environment gives the rewards (the
episode return; no reward functions), credit is per turn (objectives/gigpo.py: GiGPO, episode
GRPO ...), and StarPO-S may keep only the groups whose returns vary most. The episodes are run
token-in / token-out by rollouts/multi_turn.py over the text environments of envs/gym.py.

Tree rollouts (rollout.tree fixed, branch_at counted in TURNS; rollouts/agent_fork.py): each group
is a tree of episodes forked at turn boundaries, its leaves the rows. With
algorithm.tree_advantage other than leaf_group the per-token advantages come from the tree
(objectives/tree.py, the episode return as the leaf reward) and replace the per-turn credit, so
agent.credit must be trajectory (config/checks.py refuses the combination); with leaf_group the
per-turn credit runs over the leaves as over a flat group. Mode tree_grpo's inter-tree level
groups the trees of one prompt: here the trees whose first prompt (system + first observation)
is the same token sequence, within one process's batch (e.g. every seed of a fixed FrozenLake map;
a start state with one tree gets no inter-tree term: objectives/tree.py).
"""

from __future__ import annotations

from functools import partial
from typing import Any, ClassVar

import torch
from torch import Tensor

from grouprl.config.agent import AgentConfig
from grouprl.envs.gym import make_text_env
from grouprl.envs.tools.schemas import ToolSet, load_tools
from grouprl.envs.vector import VectorRunner
from grouprl.objectives.gigpo import agent_advantages, keep_top_groups_by_std
from grouprl.objectives.tree import tree_from_paths, tree_token_advantages
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.rollouts.chat_probe import supports
from grouprl.rollouts.multi_turn import collect_episodes
from grouprl.runtime.env_guard import EnvGuard
from grouprl.runtime.throughput import StepWork
from grouprl.types import LossOutput, Rollout
from grouprl.workloads.base import Capabilities, Collected, Parts, register
from grouprl.workloads.text import causal_lm_policy, sampling_params
from grouprl.workloads.tokens import prepare, token_micro_loss, token_work


@register
class AgentWorkload:
    """See the module docstring."""

    name: ClassVar[str] = "agent"
    capabilities: ClassVar[Capabilities] = Capabilities(
        multi_process=True, per_sample_seeding=True, tree_rollouts=True
    )
    settings: ClassVar[type] = AgentConfig

    def __init__(self, parts: Parts) -> None:
        self.cfg, self.policy, self.dist = parts.cfg, parts.policy, parts.dist
        self.params = sampling_params(parts.cfg)  # the environment gives the rewards
        if self.cfg.agent.tools:
            # what tool episodes render, probed now: a fallback is announced (or refused under
            # model.chat_fallback: error) before the run directory is touched, not at a first call
            tok = getattr(self.policy, "policy", self.policy).tokenizer
            for capability in ("tools", "tool_role"):
                supports(tok, capability)

    @classmethod
    def build_policy(cls, cfg: Any, device: torch.device) -> Any:
        return causal_lm_policy(cfg, device)

    @classmethod
    def build_rewards(cls, cfg: Any, task: Any) -> tuple[dict, dict[str, float]]:
        """The environment's episode return is the one reward."""
        if cfg.rewards:
            raise ValueError("task 'env' takes its rewards from the environment; remove `rewards`")
        return {}, {"return": 1.0}

    def max_len(self) -> int:
        return self.cfg.agent.max_total_tokens  # a whole episode's tokens

    def collect(
        self, policy: Any, examples: list[dict], *, first_group_id: int, step: int
    ) -> Collected:
        def episodes_of(part: list[dict], first: int) -> tuple[Rollout, dict]:
            got = collect(
                self.cfg, policy, part, self.params,
                group_size=self.cfg.rollout.group_size, first_group_id=first,
                tree=self.cfg.rollout.tree,
            )  # fmt: skip
            return got, {}  # no reward-function errors: the environment gives the rewards

        rollout, _ = self.dist.gather_groups(examples, first_group_id, episodes_of)
        return Collected(rollout)  # scored 0: no reward function saw the episodes

    def postprocess(self, rollout: Rollout) -> tuple[Rollout | None, dict[str, float]]:
        metrics = episode_metrics(rollout)  # over every episode, before the filter
        return keep_informative(self.cfg, rollout), metrics

    def step_work(self, rollout: Rollout) -> StepWork:
        return token_work(self.cfg, self.policy, rollout)  # runtime/throughput.py: FLOPs, MFU

    def prepare(self, scorer: Any, rollout: Rollout, weights: dict[str, float]) -> dict[str, float]:
        return prepare(self.cfg, scorer, rollout, weights, credit=self._credit)

    def _credit(self, rollout: Rollout) -> Tensor:
        if rollout.tree_path is not None and self.cfg.algorithm.tree_advantage != "leaf_group":
            return tree_advantages(self.cfg, rollout)  # [N, T]
        return advantages(self.cfg, rollout)  # [N, T]

    def micro_loss(
        self, sub: Rollout, counts: dict[str, Any], *, single_pass: bool
    ) -> tuple[LossOutput, Tensor]:
        return token_micro_loss(self.cfg, self.policy, sub, counts, single_pass=single_pass)

    def after_update(self, step: int, rollout: Rollout) -> dict[str, float]:
        return {}

    def evaluate(self, examples: list[dict], *, step: int) -> tuple[dict[str, float], list[dict]]:
        return evaluate(self.cfg, self.policy, examples, self.params, dist=self.dist)

    def accuracy_key(self) -> str:
        return "success"


# ---- episodes: collect, credit, metrics, evaluation ---------------------------------------------


def _make_env(example: dict):
    return partial(make_text_env, example["env_id"], **example.get("env_kwargs", {}))


def collect(
    cfg: Any,
    policy: Any,
    examples: list[dict],
    params: SamplingParams,
    *,
    group_size: int,
    first_group_id: int = 0,
    greedy: bool = False,
    tree: Any = None,
) -> Rollout:
    """group_size episodes per example (an env seed), all examples of one env id; tree:
    rollout.tree (fixed, branch_at in turns): each group a tree of episodes (rollouts/agent_fork.py)."""
    ag = cfg.agent
    env_ids = {(ex["env_id"], repr(ex.get("env_kwargs"))) for ex in examples}
    if len(env_ids) != 1:
        raise ValueError(f"one batch must use one environment, got {sorted(env_ids)}")
    # a step that raises (or misses agent.env_step_timeout_s) ends its episode with an error
    runner = VectorRunner(ag.env_execution, ag.env_workers)  # how the env steps of a turn run
    guard = EnvGuard(ag.env_step_timeout_s, cfg.run.fail_fast, own_process=runner.own_process)
    toolset = ToolSet(load_tools(ag.tools)) if ag.tools else None
    with runner:
        rollout = collect_episodes(
            policy, guard.wrap(_make_env(examples[0])), [ex["seed"] for ex in examples],
            group_size, params, max_turns=ag.max_turns, max_turn_tokens=ag.max_turn_tokens,
            max_total_tokens=ag.max_total_tokens, invalid_penalty=ag.invalid_penalty,
            first_group_id=first_group_id, greedy=greedy, runner=runner,
            seed=cfg.run.seed if cfg.rollout.seeding == "per_sample" and not greedy else None,
            toolset=toolset, tool_format=ag.tool_format, tree=_tree_shape(tree, ag.max_turns),
        )  # fmt: skip
    errors = guard.errors()  # one per env made; a tree makes more envs than rows (forks)
    rollout.info["env_error"] = [errors[k] for k in rollout.info.pop("env_made")]
    return rollout


def _tree_shape(tree: Any, max_turns: int) -> tuple[list[int], list[int]] | None:
    """(branching, branch_at in turns) of rollout.tree, None without a tree."""
    if tree is None or tree.type == "none":
        return None
    return list(tree.branching), tree.offsets(max_turns)  # equal turn segments by default


def keep_informative(cfg: Any, rollout: Rollout) -> Rollout:
    """StarPO-S: keep the top `agent.keep_top_groups` fraction of groups by return std."""
    if cfg.agent.keep_top_groups >= 1.0:
        return rollout
    keep = keep_top_groups_by_std(
        rollout.rewards["return"], rollout.group_ids, cfg.agent.keep_top_groups
    )  # [N]
    return rollout.select(keep.nonzero().squeeze(1))


def advantages(cfg: Any, rollout: Rollout) -> torch.Tensor:
    """Per-token advantages [N, T] from the configured credit assignment."""
    ag = cfg.agent
    return agent_advantages(
        ag.credit, rollout.rewards["return"], rollout.step_rewards, rollout.step_ids,
        rollout.anchor_keys, rollout.group_ids,
        gamma=ag.gamma, omega=ag.omega, norm=ag.norm, eps=ag.adv_eps,
    )  # fmt: skip


def same_prompt_ids(prompt_ids: Tensor, prompt_mask: Tensor) -> Tensor:
    """Long[N]: one id per distinct prompt token sequence (rows of equal prompts share it)."""
    rows = [tuple(p[m].tolist()) for p, m in zip(prompt_ids, prompt_mask)]
    ids: dict[tuple, int] = {}
    return torch.tensor([ids.setdefault(r, len(ids)) for r in rows], dtype=torch.long)  # [N]


def tree_advantages(cfg: Any, rollout: Rollout) -> Tensor:
    """Per-token advantages [N, T] of tree rollouts: algorithm.tree_advantage over the episode
    returns (mode tree_grpo: trees of the same first prompt form its inter-tree groups)."""
    a = cfg.algorithm
    parent, node_of_row = tree_from_paths(rollout.tree_path, rollout.tree_segment)
    prompts = None
    if a.tree_advantage == "tree_grpo":
        batch = rollout.actions
        prompts = same_prompt_ids(batch.prompt_ids, batch.prompt_mask).to(rollout.group_ids.device)
    return tree_token_advantages(
        parent, node_of_row, rollout.mask, rollout.rewards["return"], rollout.group_ids,
        mode=a.tree_advantage, eps=a.adv_eps, prompt_ids=prompts,
    )  # fmt: skip  # [N, T]


def episode_metrics(rollout: Rollout, prefix: str = "episode") -> dict[str, float]:
    info = rollout.info
    n = max(len(rollout), 1)
    return {
        f"{prefix}/success": sum(map(bool, info["success"])) / n,
        f"{prefix}/return": float(rollout.rewards["return"].mean()),
        f"{prefix}/turns": sum(info["turns"]) / n,
        f"{prefix}/invalid_actions": sum(info["invalid_actions"]) / n,
        "env_errors": float(sum(e is not None for e in info.get("env_error", []))),
        f"{prefix}/tool_calls": sum(info.get("tool_calls", [])) / n,
        f"{prefix}/tool_errors": sum(info.get("tool_errors", [])) / n,
    }


@torch.no_grad()
def evaluate(
    cfg: Any,
    policy: Any,
    examples: list[dict],
    params: SamplingParams,
    *,
    n_samples: int = 3,
    dist: Any = None,
) -> tuple[dict[str, float], list[dict]]:
    """Greedy episodes from the held-out seeds: success rate, mean return, turns, invalid actions;
    with eval.pass_k = k > 0 also k sampled episodes per seed (the rollout temperature):
    `sampled_success` (their mean) and `pass@k` (some episode of the seed succeeded).
    rows = the first `n_samples` greedy transcripts for samples.md. dist (several processes):
    each process runs the episodes of a contiguous share of the seeds, the per-seed results are
    gathered (runtime/distributed Dist.map_examples); the sampled episodes of seed i are group i
    (with rollout.seeding per_sample their turns are seeded from it, whatever the process)."""
    k = cfg.eval.pass_k

    def run(part: list[dict], first: int) -> list[dict]:
        greedy = collect(cfg, policy, part, params, group_size=1, greedy=True)
        info = greedy.info
        out = [{"success": float(bool(info["success"][i])),
                "return": float(greedy.rewards["return"][i]), "turns": float(info["turns"][i]),
                "invalid_actions": float(info["invalid_actions"][i]),
                "transcript": info["transcript"][i]} for i in range(len(part))]  # fmt: skip
        if k > 0:
            sampled = collect(cfg, policy, part, params, group_size=k, first_group_id=first)
            success = torch.tensor(sampled.info["success"], dtype=torch.float32).view(-1, k)
            for i, r in enumerate(out):
                r["sampled"] = success[i].tolist()  # [k]
        return out

    results = run(examples, 0) if dist is None else dist.map_examples(examples, run)
    n = max(len(results), 1)
    metrics = {  # "accuracy" = success rate: the number the curves show
        name: sum(r[key] for r in results) / n
        for name, key in (("accuracy", "success"), ("turns", "turns"),
                          ("invalid_actions", "invalid_actions"))
    }  # fmt: skip
    metrics["return"] = float(torch.tensor([r["return"] for r in results]).mean())
    if k > 0:
        success = torch.tensor([r["sampled"] for r in results], dtype=torch.float32)  # [S, k]
        metrics["sampled_success"] = float(success.mean())
        metrics[f"pass@{k}"] = float(success.amax(-1).mean())
    rows = [{"seed": ex["seed"], "transcript": r["transcript"], "success": r["success"]}
            for ex, r in zip(examples, results)][:n_samples]  # fmt: skip
    return metrics, rows
