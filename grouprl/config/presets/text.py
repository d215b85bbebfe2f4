"""Named algorithms for language models and agents (one registry with the image presets of
presets/flow.py).

Each entry is the data of one `config.presets.Preset` (presets/__init__.py registers them): `algorithm:`
fields as plain keys, other sections as "section.field" keys ("agent.credit", "rollout.group_size").

Choices and deviations (sources: METHODS.md, peers/text.md):
  grpo          kl_coef 0.0, although DeepSeekMath (arXiv 2402.03300) used beta 0.04 with k3. TRL
                defaults to beta 0 and later work (DAPO, Dr. GRPO) drops the KL for verifiable rewards;
                with 0 no reference model is loaded. kl_estimator k3 is set so that raising kl_coef
                gives the paper's estimator.
  dr_grpo       seq_mean_token_sum_norm = Dr. GRPO's constant normaliser (max length).
  dapo          overlong_buffer_frac 0.2 = L_cache / L_max = 4096 / 20480 of the verl recipe;
                max_sampling_rounds 10 = the recipe's max_num_gen_batches.
  gspo          clip range 3e-4 / 4e-4 (GSPO paper, verl example), seq_mean_token_mean as verl forces.
  gmpo          eps 0.4 / 0.4 (log-space clip). GMPO ignores the aggregation mode (plain mean over
                sequences); seq_mean_token_mean is the sequence-level mode closest to it.
  cispo         eps_low 10 (no lower bound) / eps_high 0.2 from verl's example; MiniMax-M1's own value
                of eps_high is unconfirmed. TRL's cispo caps the ratio at an absolute 5.0 instead.
  rloo          TRL's RLOO: sequence-level ratio, KL folded into the reward with k1 and beta 0.05.
                Deviation: our "sequence" ratio is length-normalised (GSPO form, exp of the mean token
                log-ratio) while TRL's RLOO exponentiates the summed log-ratio.
  reinforce_pp  verl's REINFORCE++-baseline example: k2 KL in the loss, coef 0.001, token_mean.
  gpg           plain REINFORCE surrogate, token_mean, no KL, no reference (verl example).
  hint          GRPO + rollout.hooks hint (grouprl/rollouts/hooks/hint.py): an all-fail group keeps
                one sampled row and re-samples G - 1 with a hint in the prompt, as NuRL (arXiv
                2509.25666); the hint is the first ceil(f * words) of the `solution` column, f
                annealed 0.5 -> 0 over 200 steps (GHPO's partial solutions, arXiv 2507.10628).
                Deviations: NuRL's hints are abstract and written offline by the model (use text:
                column for those); GHPO raises the share in stages per problem, here one schedule.
  replay        GRPO + rollout.hooks replay (grouprl/rollouts/hooks/replay.py): an all-fail group's
                last row becomes the prompt's newest stored success (AR3PO's response reuse, arXiv
                2509.25808; the buffer as RePO, arXiv 2506.09340, 4 successes per prompt), its
                tokens reweighted by pi_old / pi_behaviour truncated at 2 (engine_correction
                token_truncate). Deviation: RePO adds 8 replayed samples to every group with their
                own advantage normalisation; here they replace rows of all-fail groups only.
  treerpo       TreeRPO (arXiv 2506.05183): a binary tree of depth 3 (G = 8 leaves; rollout.tree
                fixed, branching [2, 2, 2], max_new_tokens in 3 equal segments unless
                segment_tokens / branch_at say otherwise), the step-level advantage of every
                segment standardised among its siblings (algorithm.tree_advantage treerpo,
                objectives/tree.py), each shared segment counted once (tree_scales
                shared_segment). Deviations: the paper's N, D and L_step for its runs are
                unconfirmed here (its code could not be read), so the tree's shape is our choice;
                the sibling standardisation follows the paper's description [unconfirmed].
  greso         GRESO (arXiv 2506.02177), from the official train-scripts/*_greso.sh and verl
                config of Infini-AI-Lab/GRESO: GRPO, clip 0.2, token-mean loss, entropy bonus 0.001,
                no KL, G = 8, DAPO dynamic sampling after the rollout, and the pre-rollout selector
                rollout.budget greso (p_easy = p_hard = 0.5, target zero-variance 25%, 1/3 of it
                easy, step 0.01 within [0.05, 0.95]). Deviations: max_sampling_rounds 10 caps the
                dynamic-sampling rounds (the official loop has no cap); the first round's skipped
                prompts are replaced by further draws, and each later round samples what the
                kept share says is missing (algorithm.resample_size needed: the official adaptive
                sampling batch size, estimated from this step's rounds instead of a running
                average); easy / hard are pass / fail of the correctness reward (grouprl/rollouts/budget/
                greso.py lists every deviation of the selector).
  tree_grpo     Tree-GRPO (arXiv 2509.21240), for the agent workload: each group is a tree of
                episodes whose nodes are turns (rollouts/agent_fork.py; rollout.tree fixed,
                branching [2, 2, 2], branch_at in turns, default agent.max_turns in 3 equal
                parts), advantage = intra-tree GRPO + inter-tree GRPO of the episode return on
                every agent token of the leaf path (algorithm.tree_advantage tree_grpo; the inter
                level groups the trees of one start state), summed with weight 1, shared turns
                trained once per leaf (tree_scales none), eps 1e-6: as the official code
                (AMAP-ML/Tree-GRPO, ray_trainer_ts.py, estimator "tree"), read for
                objectives/tree.py. agent.credit trajectory (the tree's advantage replaces the
                per-turn credit). Deviations: the paper grows M trees per prompt by L rounds of
                random expansion of N nodes each; here one tree of fixed shape per group, forked
                at fixed turn counts (the shape is our choice; M, N, L of the paper's runs are
                unconfirmed here); a start state with a single tree gets no inter-tree term (the
                code adds the intra-tree advantage twice there), so a tree of depth 1 trains like
                GRPO bit for bit; a group of one leaf gets 0 where the code gives the raw reward;
                clip 0.2 / seq_mean_token_mean / no KL are this registry's GRPO core
                [unconfirmed against the paper's runs].
  opd           on-policy distillation alone: pg_coef 0 and algorithm.distill {estimator k1,
                coef 1.0}: per-token reverse KL(student || teacher) on the student's own samples,
                the k1 score-function form, -(ls - lt) as a per-token advantage (Thinking
                Machines, "On-Policy Distillation", blog 2025; GKD arXiv 2306.13649 with student
                data fraction 1 and the reverse KL). Deviations: GKD's main form is the exact
                (full-vocabulary) divergence, ours is k1 on the sampled tokens (estimator full is
                the GKD form); the blog's loss is an importance-sampled policy gradient with the
                sampling weights' log-probs in the advantage, ours uses the current weights' (the
                same at the first update of a batch); the blog's discount factor is zero (each
                token's own KL only), as here; aggregation token_mean is our choice; no KL to a
                reference (kl_coef 0), and the rewards are still computed (logged, unused with
                pg_coef 0). The teacher folder is never part of a preset:
                algorithm.distill.teacher must be set (validation names it).
"""

from __future__ import annotations


def _clip(eps_low: float = 0.2, eps_high: float = 0.2, **more: float) -> dict:
    """The PPO-clip surrogate mapping (algorithm.surrogate, grouprl/config/surrogates.py)."""
    return {"type": "clip", "eps_low": eps_low, "eps_high": eps_high, **more}


_CLIP = {"surrogate": _clip(), "ratio_level": "token"}
_NO_KL = {"kl_coef": 0.0}
_GRPO_CORE = {
    "advantage": "grpo",
    "scale": "group",
    **_CLIP,
    "aggregation": "seq_mean_token_mean",
    **_NO_KL,
}

TEXT_PRESETS: list[dict] = [
    dict(
        name="grpo",
        arxiv="2402.03300",
        summary="Group-normalised advantages with a PPO clipped surrogate (DeepSeekMath).",
        settings={
            "advantage": "grpo",
            "scale": "group",
            "surrogate": _clip(0.2, 0.2),
            "ratio_level": "token",
            "aggregation": "seq_mean_token_mean",
            **_NO_KL,
            "kl_estimator": "k3",
            "kl_mode": "loss",
        },
    ),
    dict(
        name="dr_grpo",
        arxiv="2503.20783",
        summary="GRPO without std scaling or length normalisation, which bias it (Dr. GRPO).",
        settings={
            "advantage": "dr_grpo",
            "scale": "none",
            "surrogate": _clip(0.2, 0.2),
            "ratio_level": "token",
            "aggregation": "seq_mean_token_sum_norm",
            **_NO_KL,
        },
    ),
    dict(
        name="dapo",
        arxiv="2503.14476",
        summary="Clip-higher, token-mean loss, zero-variance dynamic sampling and soft overlong penalty.",
        settings={
            "advantage": "grpo",
            "scale": "group",
            "surrogate": _clip(0.2, 0.28),
            "ratio_level": "token",
            "aggregation": "token_mean",
            **_NO_KL,
            "dynamic_sampling": "zero_variance",
            "max_sampling_rounds": 10,
            "overlong_shaping": "soft",
            "overlong_buffer_frac": 0.2,
            "overlong_factor": 1.0,
        },
    ),
    dict(
        name="gspo",
        arxiv="2507.18071",
        summary="Sequence-level (length-normalised) importance ratio with a tiny clip range (Qwen GSPO).",
        settings={
            "advantage": "grpo",
            "scale": "group",
            "surrogate": _clip(3e-4, 4e-4),
            "ratio_level": "sequence",
            "aggregation": "seq_mean_token_mean",
            **_NO_KL,
        },
    ),
    dict(
        name="gmpo",
        arxiv="2507.20673",
        summary="Geometric mean of token ratios, clipped in log space with a wide range (GMPO).",
        settings={
            "advantage": "grpo",
            "scale": "group",
            "surrogate": _clip(0.4, 0.4),
            "ratio_level": "geometric",
            "aggregation": "seq_mean_token_mean",
            **_NO_KL,
        },
    ),
    dict(
        name="cispo",
        arxiv="2506.13585",
        summary="Clip the stop-gradient importance weight, not the update; every token keeps a gradient.",
        settings={
            "advantage": "grpo",
            "scale": "group",
            "surrogate": {"type": "cispo", "eps_low": 10.0, "eps_high": 0.2},
            "ratio_level": "token",
            "aggregation": "token_mean",
            **_NO_KL,
        },
    ),
    dict(
        name="sapo",
        arxiv="2511.20347",
        summary="Smooth sigmoid gate on the token ratio instead of a hard clip (Qwen SAPO).",
        settings={
            "advantage": "grpo",
            "scale": "group",
            "surrogate": {"type": "sapo", "tau_pos": 1.0, "tau_neg": 1.05},
            "ratio_level": "token",
            "aggregation": "seq_mean_token_mean",
            **_NO_KL,
        },
    ),
    dict(
        name="rloo",
        arxiv="2402.14740",
        summary="Leave-one-out baseline, sequence-level clipped ratio, KL folded into the reward.",
        settings={
            "advantage": "rloo",
            "surrogate": _clip(0.2, 0.2),
            "ratio_level": "sequence",
            "aggregation": "seq_mean_token_mean",
            "kl_coef": 0.05,
            "kl_estimator": "k1",
            "kl_mode": "reward",
        },
    ),
    dict(
        name="reinforce_pp",
        arxiv="2501.03262",
        summary="Group-mean baseline whitened over the batch, PPO clip, k2 KL in the loss (REINFORCE++).",
        settings={
            "advantage": "reinforce_pp_baseline",
            "surrogate": _clip(0.2, 0.2),
            "ratio_level": "token",
            "aggregation": "token_mean",
            "kl_coef": 0.001,
            "kl_estimator": "k2",
            "kl_mode": "loss",
        },
    ),
    dict(
        name="gpg",
        arxiv="2504.02546",
        summary="Plain policy gradient with a rescaled group baseline; no ratio, clip, KL or reference.",
        settings={
            "advantage": "gpg",
            "surrogate": {"type": "reinforce"},
            "ratio_level": "token",
            "aggregation": "token_mean",
            **_NO_KL,
        },
    ),
    # ---- methods of the field (issue 8; formulas in METHODS.md) ----
    dict(
        name="lambda_grpo",
        arxiv="2509.21154",
        summary="GRPO with each token's loss divided by the number of group members sharing its prefix.",
        settings={**_GRPO_CORE, "token_scale": "prefix_share"},
    ),
    dict(
        name="pmd_mean",
        arxiv="2602.05933",
        summary="Leave-one-out advantage; squared-error regression of the sequence log-ratio onto A/tau.",
        settings={
            "advantage": "rloo",
            "surrogate": {"type": "pmd", "tau": 0.01},
            "ratio_level": "token",
            "aggregation": "seq_mean_token_mean",
            **_NO_KL,
        },
    ),
    dict(
        name="tpo",
        arxiv="2604.06159",
        summary="Cross-entropy fit of the group softmax to the old policy tilted by exp(u / eta).",
        settings={
            "advantage": "tpo",
            "surrogate": {"type": "tpo", "eta": 1.0},
            "ratio_level": "token",
            **_NO_KL,
        },
    ),
    dict(
        name="delta_l",
        arxiv="2509.07558",
        summary="GRPO advantages with length weights L^-alpha normalised over the batch, constant normaliser.",
        settings={
            "advantage": "grpo",
            "scale": "group",
            "surrogate": _clip(0.2, 0.3, dual_clip_c=3.0),
            "ratio_level": "token",
            "aggregation": "delta_l",
            "delta_l_alpha": 0.75,
            **_NO_KL,
        },
    ),
    dict(
        name="dump",
        arxiv="2504.09710",
        summary="GRPO with a UCB curriculum over data sources scored by mean |advantage|.",
        settings={
            **_GRPO_CORE,
            "kl_coef": 0.001,
            "kl_estimator": "k3",
            "kl_mode": "loss",
            "curriculum.type": "dump",
        },
    ),
    dict(
        name="egsw",
        arxiv="2503.22456",
        summary="GRPO re-weighted by a group softmax of (advantage + alpha * entropy) / P (partly unconfirmed).",
        settings={**_GRPO_CORE, "egsw": "sequence", "egsw_alpha": 0.1, "egsw_temperature": 1.0},
    ),
    dict(
        name="entropy_only",
        arxiv="2504.20571",
        summary="No policy-gradient term: only a token-mean entropy bonus (+0.001), no KL, temperature 0.6.",
        settings={
            **_GRPO_CORE,
            "pg_coef": 0.0,
            "entropy_coef": 0.001,
            "aggregation": "token_mean",
            "rollout.temperature": 0.6,
        },
    ),
    dict(
        name="two_grpo",
        arxiv="2510.00977",
        summary="Plain GRPO with groups of two (a DPO-like contrastive pair per prompt).",
        settings={**_GRPO_CORE, "rollout.group_size": 2},
    ),
    dict(
        name="gigpo",
        arxiv="2505.10978",
        summary="Multi-turn agents: episode advantage plus step advantage from identical anchor states.",
        settings={
            **_GRPO_CORE,
            "kl_coef": 0.01,
            "kl_estimator": "k3",
            "kl_mode": "loss",
            "agent.credit": "gigpo",
            "agent.gamma": 0.95,
            "agent.omega": 1.0,
            "agent.norm": "mean_std_norm",
            "agent.invalid_penalty": 0.1,
        },
    ),
    dict(
        name="hint",
        arxiv="2509.25666",
        summary="GRPO that re-samples all-fail groups with a partial reference solution as hint.",
        settings={
            **_GRPO_CORE,
            "rollout.hooks": (
                {
                    "type": "hint",
                    "text": "solution_prefix",
                    "column": "solution",
                    "where": "prompt",
                    "context": "hinted",
                    "keep_sampled": 1,
                    "start_fraction": 0.5,
                    "end_fraction": 0.0,
                    "anneal_steps": 200,
                },
            ),  # fmt: skip
        },
    ),
    dict(
        name="replay",
        arxiv="2509.25808",
        summary="GRPO that puts a prompt's past success into its all-fail groups, IS-corrected.",
        settings={
            **_GRPO_CORE,
            "engine_correction": "token_truncate",
            "engine_correction_max": 2.0,
            "rollout.hooks": ({"type": "replay", "per_group": 1, "per_prompt": 4},),
        },
    ),
    dict(
        name="greso",
        arxiv="2506.02177",
        summary="GRPO + dynamic sampling, skipping prompts predicted zero-variance before rollout.",
        settings={
            **_GRPO_CORE,
            "aggregation": "token_mean",
            "entropy_coef": 0.001,
            "dynamic_sampling": "zero_variance",
            "max_sampling_rounds": 10,
            "resample_size": "needed",
            "rollout.group_size": 8,
            "rollout.budget": {
                "type": "greso",
                "p_easy": 0.5,
                "p_hard": 0.5,
                "target_zero_variance": 0.25,
                "easy_share": 1 / 3,
                "p_step": 0.01,
                "p_min": 0.05,
                "p_max": 0.95,
                "min_keep": 0.01,
            },
        },
    ),
    dict(
        name="treerpo",
        arxiv="2506.05183",
        summary="GRPO on a sampled tree: each segment's advantage is its value among its siblings.",
        settings={
            **_GRPO_CORE,
            "tree_advantage": "treerpo",
            "tree_scales": "shared_segment",
            "rollout.group_size": 8,
            "rollout.tree": {"type": "fixed", "branching": [2, 2, 2]},
        },
    ),
    dict(
        name="tree_grpo",
        arxiv="2509.21240",
        summary="Agents: episodes sampled as a tree over turns; intra-tree plus inter-tree GRPO advantage.",
        settings={
            **_GRPO_CORE,
            "adv_eps": 1e-6,
            "tree_advantage": "tree_grpo",
            "tree_scales": "none",
            "rollout.group_size": 8,
            "rollout.tree": {"type": "fixed", "branching": [2, 2, 2]},
            "agent.credit": "trajectory",
        },
    ),
    dict(
        name="opd",
        arxiv="2306.13649",
        summary="On-policy distillation alone: per-token reverse KL to a teacher on the student's samples (k1).",
        settings={
            **_GRPO_CORE,
            "pg_coef": 0.0,
            "aggregation": "token_mean",
            "distill": {"estimator": "k1", "coef": 1.0},
        },
    ),
]
