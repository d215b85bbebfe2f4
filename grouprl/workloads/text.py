"""Single-turn text: a prompt, G completions from a causal LM, reward functions on the text.

The workload of verifiable tasks (math, countdown, code ...) and of model-based text rewards:
collect = rollouts/single_turn.py (each process samples its share of the groups), prepare =
workloads/tokens.py (old / reference log-probs, group advantages, token scales; the token loss),
evaluation = greedy accuracy and pass@k on the held-out split (below).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from grouprl.envs.rewards import RewardFn
from grouprl.policies.text.causal_lm import LOCAL_ENGINES, CausalLMPolicy
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.policies.text.engines.sync import engine_mismatch
from grouprl.policies.text.teacher import TeacherModel
from grouprl.rollouts.batching import single_pass
from grouprl.rollouts.chat_probe import set_chat_fallback
from grouprl.rollouts.seeds import sample_seed
from grouprl.rollouts.single_turn import collect
from grouprl.runtime.build import build_rewards
from grouprl.runtime.reward_guard import drain_reward_metrics
from grouprl.runtime.throughput import StepWork
from grouprl.types import LossOutput, Rollout
from grouprl.workloads.base import Capabilities, Collected, Parts, register
from grouprl.workloads.tokens import prepare, token_micro_loss, token_work


def causal_lm_policy(
    cfg: Any, device: torch.device, loaded: tuple[Any, Any] | None = None
) -> CausalLMPolicy:
    """model: -> CausalLMPolicy, its engine from rollout.engine; loaded: (transformers model,
    tokenizer) given from Python (the Python API) instead of model.name_or_path, in the dtype
    model.dtype names."""
    m = cfg.model
    settings = dict(
        lora=m.lora.model_dump() if m.lora else None,
        gradient_checkpointing=m.gradient_checkpointing,
        logprob_chunk_size=m.logprob_chunk_size,
        logprob_path=m.logprob_path,
        # the frozen copy is made before any checkpoint is loaded, so it stays the initial model
        need_reference=cfg.algorithm.kl_coef > 0,
    )
    if loaded is not None and cfg.rollout.engine not in LOCAL_ENGINES:
        raise ValueError(
            f"rollout.engine={cfg.rollout.engine!r} loads the model from model.name_or_path; a "
            f"model given as an object samples with one of {sorted(LOCAL_ENGINES)}"
        )
    engine = TEXT_ENGINES[cfg.rollout.engine](cfg, device)
    if loaded is not None:
        model, tokenizer = loaded
        policy = CausalLMPolicy(model, tokenizer, compute_dtype=m.dtype, engine=engine, **settings)
    else:
        from grouprl.policies.support import check_model_support  # a hub id's config.json

        check_model_support(m, uses_vllm=cfg.rollout.engine.startswith("vllm"), at_load=True)
        policy = CausalLMPolicy.from_pretrained(
            m.name_or_path, dtype=m.dtype, trust_remote_code=m.trust_remote_code, engine=engine,
            **settings,
        )  # fmt: skip
    set_chat_fallback(policy.tokenizer, m.chat_fallback)  # what a template lacking a role gets
    return policy.to(device)


def distill_teacher(cfg: Any, policy: Any) -> Any:
    """algorithm.distill -> the frozen teacher beside the policy (None when off), built once
    before the run directory is touched: source model, a TeacherModel in model.dtype on the
    policy's device; source engine, a vLLM engine on the teacher folder that scores the sampled
    tokens (engines/vllm.py). Errors name algorithm.distill.teacher (a missing folder, another
    tokenizer)."""
    d = getattr(cfg.algorithm, "distill", None)
    if d is None:
        return None
    student = getattr(policy, "policy", policy)  # runtime/distributed's wrapper holds it
    if d.source == "engine":
        from grouprl.policies.text.engines.vllm_setup import teacher_from_config  # imports vllm

        return teacher_from_config(cfg, student.tokenizer)
    teacher = TeacherModel.from_folder(
        d.teacher, student_tokenizer=student.tokenizer,
        student_model=student.model if d.estimator == "full" else None,
        dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code,
        path=cfg.model.logprob_path,
    )  # fmt: skip
    return teacher.to(student.device_of_model())


def sampling_params(cfg: Any) -> SamplingParams:
    """rollout: -> the engine's sampling parameters."""
    r = cfg.rollout
    return SamplingParams(
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop=list(r.stop),
    )


def _vllm_engine(cfg: Any, device: torch.device):
    from grouprl.policies.text.engines.vllm_setup import engine_from_config  # imports vllm: lazily

    return engine_from_config(cfg, device)


def _server_engine(cfg: Any, device: torch.device):
    from grouprl.policies.text.engines.server.client import VLLMServerEngine

    s = cfg.rollout.server
    return VLLMServerEngine(
        s.url, timeout_s=s.timeout_s, connect_timeout_s=s.connect_timeout_s,
        weight_timeout_s=s.weight_timeout_s, channel_host=s.channel_host,
        channel_port=s.channel_port, backend=s.backend, seed=cfg.run.seed,
        push_check=s.push_check,
    )  # fmt: skip


# rollout.engine -> the policy's engine; None: CausalLMPolicy's HFEngine over its own model, a
# string: that CausalLMPolicy.LOCAL_ENGINES engine over its own model
TEXT_ENGINES = {
    "hf": lambda cfg, device: None,
    "fast": lambda cfg, device: "fast",
    "vllm": _vllm_engine,
    "vllm_server": _server_engine,
}


@register
class TextWorkload:
    """See the module docstring. reward_fns: name -> batched reward function; weights: their
    weights in the combined reward."""

    name: ClassVar[str] = "text"
    capabilities: ClassVar[Capabilities] = Capabilities(
        multi_process=True, async_rollouts=True, per_sample_seeding=True, curriculum=True,
        prompt_guard=True, signal_hooks=True, budget=True, tree_rollouts=True,
        distillation=True,
    )  # fmt: skip
    settings: ClassVar[None] = None

    def __init__(self, parts: Parts) -> None:
        self.cfg, self.policy, self.dist = parts.cfg, parts.policy, parts.dist
        self.reward_fns = parts.reward_fns  # name -> batched function
        self.params = sampling_params(parts.cfg)
        self.teacher = distill_teacher(parts.cfg, parts.policy)  # once per run; None: off

    @classmethod
    def build_policy(cls, cfg: Any, device: torch.device) -> CausalLMPolicy:
        return causal_lm_policy(cfg, device)

    @classmethod
    def build_rewards(cls, cfg: Any, task: Any) -> tuple[dict, dict[str, float]]:
        return build_rewards(cfg, task, required=True)

    def max_len(self) -> int:
        return self.cfg.rollout.max_new_tokens  # one completion

    def collect(
        self,
        policy: Any,
        examples: list[dict],
        *,
        first_group_id: int,
        step: int,
        group_sizes: list[int] | None = None,
        response_prefixes: list[str] | None = None,
    ) -> Collected:
        """group_sizes: one G per example (rollout.budget allocate, hint re-samples); None:
        rollout.group_size. response_prefixes: one forced completion start per example
        (rollout.hooks hint)."""
        cfg, first_errors = self.cfg, {}
        seed = cfg.run.seed if cfg.rollout.seeding == "per_sample" else None
        sizes = group_sizes or [cfg.rollout.group_size] * len(examples)
        tree = cfg.rollout.tree if cfg.rollout.tree.type != "none" else None

        def make(part: list[dict], first: int) -> tuple[Rollout, dict]:
            lo = first - first_group_id  # a process's share is a contiguous run of the examples
            own = sizes[lo : lo + len(part)]
            prefixes = None if response_prefixes is None else response_prefixes[lo : lo + len(part)]
            return collect(
                policy, part, own[0] if len(set(own)) == 1 else own, self.params,
                self.reward_fns, first_group_id=first, fail_fast=cfg.run.fail_fast, seed=seed,
                first_errors=first_errors, response_prefixes=prefixes, tree=tree,
            )  # fmt: skip

        rollout, errors = self.dist.gather_groups(examples, first_group_id, make)
        return Collected(rollout, len(rollout), errors, first_errors)

    def postprocess(self, rollout: Rollout) -> tuple[Rollout | None, dict[str, float]]:
        return rollout, {}

    def step_work(self, rollout: Rollout) -> StepWork:
        return token_work(self.cfg, self.policy, rollout)  # runtime/throughput.py: FLOPs, MFU

    def prepare(self, scorer: Any, rollout: Rollout, weights: dict[str, float]) -> dict[str, float]:
        return prepare(self.cfg, scorer, rollout, weights, teacher=self.teacher)

    def micro_loss(
        self, sub: Rollout, counts: dict[str, Any], *, single_pass: bool
    ) -> tuple[LossOutput, Tensor]:
        return token_micro_loss(
            self.cfg, self.policy, sub, counts, single_pass=single_pass, teacher=self.teacher
        )

    def after_update(self, step: int, rollout: Rollout) -> dict[str, float]:
        return step_mismatch(self.cfg, rollout)

    def evaluate(self, examples: list[dict], *, step: int) -> tuple[dict[str, float], list[dict]]:
        e = self.cfg.eval
        metrics, rows = evaluate(
            self.policy, examples, self.reward_fns, self.params,
            batch_size=e.batch_size, pass_k=e.pass_k, dist=self.dist,
            seed=self.cfg.run.seed if self.cfg.rollout.seeding == "per_sample" else None,
        )  # fmt: skip
        # isolated rewards' counts, summed over processes
        metrics.update(self.dist.sum_counts(drain_reward_metrics(self.reward_fns)))
        return metrics, rows

    def accuracy_key(self) -> str:
        return accuracy_key(self.reward_fns)


def step_mismatch(cfg: Any, rollout: Rollout) -> dict[str, float]:
    """engine_mismatch over the batch, after the update: rollout.old_logp then holds the trainer's
    scores under the sampling weights (recompute mode, and every single-pass step, where the update
    writes them). Empty without engine log-probs, or with old_logp 'engine' over several updates
    (no trainer score of the sampling weights is made then)."""
    if rollout.engine_logp is None or (cfg.rollout.old_logp == "engine" and not single_pass(cfg)):
        return {}
    return engine_mismatch(rollout.old_logp, rollout.engine_logp, rollout.mask)


# ---- held-out evaluation: greedy accuracy and pass@k ---------------------------------------------


def accuracy_key(reward_fns: dict[str, RewardFn]) -> str:
    """The reward that counts as correctness: "accuracy" when present, else the first one."""
    return "accuracy" if "accuracy" in reward_fns else next(iter(reward_fns))


@torch.no_grad()
def evaluate(
    policy: Any,
    examples: list[dict],
    reward_fns: dict[str, RewardFn],
    params: SamplingParams,
    *,
    batch_size: int,
    pass_k: int = 0,
    n_samples: int = 4,
    dist: Any = None,
    seed: int | None = None,
) -> tuple[dict[str, float], list[dict]]:
    """Greedy accuracy (mean of the correctness reward, NaN counted as wrong), mean greedy length,
    and pass@k (k samples at the rollout temperature; a problem passes if any sample scores >= 1).

    dist (several processes): each process evaluates a contiguous share of whole batches of
    `batch_size` examples (the batches of one process) and the per-example results are gathered
    (runtime/distributed Dist.map_examples), so the metrics are the one-process metrics. seed
    (rollout.seeding per_sample): the pass@k samples of example i come from per-sample generators
    seeded from (eval_seed(seed), i, j), independent of the batches and the process count; None:
    torch's global RNG.

    Returns (metrics, rows): rows are the first `n_samples` greedy completions for the sample table.
    """
    key = accuracy_key(reward_fns)
    scorer = {key: reward_fns[key]}
    seeded = {} if seed is None else {"seed": eval_seed(seed)}

    def run(part: list[dict], first: int) -> list[dict]:
        out: list[dict] = []
        for start in range(0, len(part), batch_size):
            chunk = part[start : start + batch_size]
            greedy, _ = collect(policy, chunk, 1, params, scorer, greedy=True)
            correct = torch.nan_to_num(greedy.rewards[key], nan=0.0)  # [b]
            lengths = greedy.actions.lengths.float()  # [b]
            passed = None
            if pass_k > 0:
                sampled, _ = collect(policy, chunk, pass_k, replace(params), scorer,
                                     first_group_id=first + start, **seeded)  # fmt: skip
                best = torch.nan_to_num(sampled.rewards[key], nan=0.0).view(len(chunk), pass_k)
                passed = (best.max(1).values >= 1.0).float()  # [b]
            out += [{"correct": float(correct[i]), "length": float(lengths[i]),
                     "passed": None if passed is None else float(passed[i]),
                     "row": {"prompt": greedy.info["prompt"][i],
                             "completion": greedy.info["completion"][i],
                             key: float(greedy.rewards[key][i]),
                             "answer": chunk[i].get("answer", "")}}
                    for i in range(len(chunk))]  # fmt: skip
        return out

    results = (
        run(examples, 0) if dist is None else dist.map_examples(examples, run, unit=batch_size)
    )
    metrics = {
        "accuracy": _mean([r["correct"] for r in results]),
        "response_length": _mean([r["length"] for r in results]),
    }
    if pass_k > 0:
        metrics[f"pass@{pass_k}"] = _mean([r["passed"] for r in results])
    return metrics, [r["row"] for r in results[:n_samples]]


def eval_seed(seed: int) -> int:
    """The seed of evaluation's sampled completions in a run seeded `seed` (a stream of its own,
    apart from the training samples' per-sample seeds)."""
    return sample_seed(seed, -1, 0)


def _mean(values: list[float]) -> float:
    """The float32 mean, as torch.cat(...).mean() of the per-batch tensors gave it."""
    return float(torch.tensor(values, dtype=torch.float32).mean())
