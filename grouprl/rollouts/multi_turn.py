"""Multi-turn rollouts: G episodes per environment seed, token-in / token-out, one Rollout.

The trajectory layout follows the "whole trajectory as one chat sequence" design of RAGEN /
StarPO (arXiv 2504.20073) and SkyRL, with GiGPO's (arXiv 2505.10978) per-step records:
`step_rewards`, `step_ids` and the anchor state of every step. Deviations and choices:

- Token-in / token-out: the ids trained on are exactly the ids the engine sampled; assistant text
  is decoded only to hand it to the env. Observations are appended as the chat template's delta
  against a fixed dummy conversation (SkyRL's approach; rollouts/chat_delta.py), tokenised on their
  own, and masked out.
- The sampled end of turn (any stop id: the generation config's EOS ids and the tokenizer's,
  policies/text/stop_ids.py) is the assistant's closing marker when the template closes turns with
  its text (Qwen's <|im_end|>, Gemma's <end_of_turn>, Phi-3's <|end|>); otherwise (stop string,
  per-turn budget hit) the full closing text is appended as env tokens.
- Context budget: a turn is only started when its worst case (context + max_turn_tokens) fits in
  max_total_tokens; an episode that cannot fit another turn ends cleanly as truncated. No
  observation is appended after the last turn (those tokens would be masked and never attended).
- Invalid actions (info["valid_action"] False) subtract `invalid_penalty` from that step's reward,
  as verl-agent's invalid-action penalty does (its default 0.1).
- TokenBatch.truncated means the *episode* was truncated (turn limit, context, env truncation).
- Tools (item "tools for real"): with a `ToolSet` (config `agent.tools`) every assistant turn is
  parsed for tool calls in the configured format (envs/tools/formats.py); a turn with calls
  runs ALL of them in order (the env is not stepped; the turn's reward is 0, minus the invalid
  penalty when a call failed) and their results come back as `tool` messages rendered by the
  template; a turn without calls goes to the env. The schemas (the ToolSet's and an env's own
  `tools` attribute) are passed as `tools=` to the chat template when it renders them (probed,
  rollouts/chat_probe.py), else listed as plain text in the system prompt; a template without a
  tool role gets the results as a user message (announced once). An env marks an observation
  that is a tool's output with info["observation_role"] = "tool" (and info["tool_name"]); it is
  then a `tool` message too.
  GiGPO anchors of tool turns are (env anchor, tool results so far).
- Observations and tool results are made valid UTF-8 before encoding (lone surrogates -> "?").
- Tree rollouts (rollout.tree, `tree=`): each group is sampled as a tree whose nodes are turns,
  forked at turn counts (rollouts/agent_fork.py); the leaves are the rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import Any

from grouprl.envs.tools.formats import (
    assistant_tool_calls,
    call_id,
    parse_tool_calls,
    resolve_tool_format,
    text_outside_calls,
    tool_messages,
)
from grouprl.envs.tools.schemas import (
    ToolSet,
    template_supports_tools,
    tools_system_prompt,
    valid_utf8,
)
from grouprl.envs.vector import VectorRunner
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.rollouts.agent_fork import Forker, check_turn_tree, root_episodes, tree_fields
from grouprl.rollouts.chat_delta import (
    first_messages,
    messages_delta_ids,
    observation_delta_ids,
    prompt_ids,
)
from grouprl.rollouts.episode_record import Episode, assemble
from grouprl.rollouts.seeds import turn_seed
from grouprl.types import Rollout


def _env_attr(env: Any, name: str, default: Any) -> Any:
    """An attribute of the env or of the env under gymnasium wrappers (which do not forward)."""
    if hasattr(env, name):
        return getattr(env, name)
    getter = getattr(env, "get_wrapper_attr", None)
    if getter is not None:
        try:
            return getter(name)
        except AttributeError:
            pass
    return default


def _anchor(info: dict, observation: str) -> Hashable:
    if not isinstance(observation, str):
        raise TypeError(
            f"a text env must return str observations, got {type(observation).__name__}; "
            "wrap the env so that it renders its observations as text"
        )
    key = info.get("anchor", observation)
    try:
        hash(key)
    except TypeError:
        raise TypeError(
            f'info["anchor"] must be hashable (GiGPO groups steps by it), got {type(key).__name__}'
        ) from None
    return key


def _fence(text: str) -> str:
    """`text` in a markdown code block whose fence is longer than any backtick run inside it."""
    run, longest = 0, 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"


def collect_episodes(
    policy: Any,
    make_env: Callable[[], Any],
    seeds: list[int],
    group_size: int,
    params: SamplingParams,
    *,
    max_turns: int,
    max_turn_tokens: int | None = None,
    max_total_tokens: int | None = None,
    invalid_penalty: float = 0.1,
    first_group_id: int = 0,
    greedy: bool = False,
    runner: VectorRunner | None = None,
    seed: int | None = None,
    toolset: ToolSet | None = None,
    tool_format: str = "auto",
    tree: tuple[list[int], list[int]] | None = None,
) -> Rollout:
    """Run `group_size` episodes per seed (group ids first_group_id, +1, ... one per seed) with
    batched generation over all live episodes each turn, and their env resets / steps run
    together by `runner` (envs/vector.py; default: sequential in this process). seed: turn t of
    episode j of group g samples from its own generator seeded by (seed, g, j, t)
    (rollout.seeding per_sample: episodes then do not depend on the batch or the process count);
    None: torch's global RNG.

    Returns a Rollout: actions = TokenBatch (prompt = system + first observation with the
    generation prompt; completion = assistant turns and observation deltas), mask / step_ids
    (turn index, -1 on env tokens) / engine_logp (0 on env tokens) [N, T], step_rewards
    [N, max_turns] (NaN after the end), anchor_keys[i][turn], rewards["return"] (sum of step
    rewards incl. penalties) and info lists: transcript (markdown), success, turns,
    invalid_actions, cut_turns (turns that hit max_turn_tokens), end_reason, seed, messages (the
    chat, ending with the last observation, which is not in the tokens), prompt, completion,
    tool_calls / tool_errors (calls the rollout's tools ran, and those that failed, per episode).
    toolset / tool_format: tools the rollout runs itself (see the module docstring); tool_format
    "auto" reads the call format off the chat template. tree: (branching, branch_at in turns):
    each group a tree of episodes forked at turn boundaries (rollouts/agent_fork.py), group_size
    must be the product of branching; the Rollout then has tree_path / tree_segment / generated.
    info["env_made"]: the position, in the order envs were made, of each row's env.
    """
    turn_budget = max_turn_tokens if max_turn_tokens is not None else params.max_new_tokens
    if not seeds or group_size < 1 or max_turns < 1 or turn_budget < 1:
        raise ValueError(
            f"need >= 1 seed, group_size >= 1, max_turns >= 1 and max_turn_tokens >= 1, got "
            f"{len(seeds)} seeds, {group_size}, {max_turns}, {turn_budget}"
        )
    if not (math.isfinite(invalid_penalty) and invalid_penalty >= 0):
        raise ValueError(f"invalid_penalty must be finite and >= 0, got {invalid_penalty}")
    tok, turn_params = policy.tokenizer, replace(params, max_new_tokens=turn_budget)
    stops = set(policy.stop_ids)  # the ids that end a turn (policies/text/stop_ids.py)
    limit = max_total_tokens if max_total_tokens is not None else math.inf
    runner = runner if runner is not None else VectorRunner("sequential")
    fmt = resolve_tool_format(tool_format, tok)
    branching, branch_at = tree if tree is not None else ([group_size], [])
    check_turn_tree(branching, branch_at, max_turns)
    if math.prod(branching) != group_size:
        raise ValueError(f"tree branching {branching} has {math.prod(branching)} leaves, not "
                         f"group_size={group_size}")  # fmt: skip
    made: list[Any] = []  # every env made, in order (forks re-create envs)

    def env_of() -> Any:
        made.append(make_env())
        return made[-1]

    forker = Forker(env_of, {first_group_id + g: branching[0] + 1 for g in range(len(seeds))})
    level = 0  # branch points passed
    episodes: list[Episode] = []
    tool_log: dict[int, list[str]] = {}  # id(episode) -> tool results so far (anchors)
    base_anchor: dict[int, Hashable] = {}  # id(episode) -> env anchor the tool results extend
    try:
        for g, env_seed in enumerate(seeds):  # appended as made: `finally` closes every env made
            episodes += root_episodes(env_of, first_group_id + g, env_seed, branching[0])
        starts = runner.reset([e.env for e in episodes], [e.seed for e in episodes])
        schemas = _tool_schemas(episodes[0].env, toolset)
        tools = schemas if schemas and template_supports_tools(tok) else None
        extra_prompt = tools_system_prompt(toolset, tok, fmt) if toolset is not None else ""
        for g in range(len(seeds)):
            members = slice(g * branching[0], (g + 1) * branching[0])
            _start_group(policy, episodes[members], starts[members], tools, extra_prompt)
        for e in episodes:
            if len(e) + turn_budget > limit:
                raise ValueError(
                    f"the first prompt (seed {e.seed}) has {len(e.prompt)} tokens, leaving no room "
                    f"for one turn of {turn_budget} tokens within max_total_tokens={limit}"
                )
        for turn in range(max_turns):
            while level < len(branch_at) and branch_at[level] == turn:  # a branch point
                episodes = _fork(forker, episodes, branching[level + 1], tool_log, base_anchor)
                level += 1
            live = [e for e in episodes if not e.end]
            if not live:
                break
            sampling = (
                {}
                if seed is None
                else {"seeds": [turn_seed(seed, *e.seed_key(), turn) for e in live]}
            )
            out = policy.engine.generate(
                [e.prompt + e.ids for e in live], turn_params, greedy=greedy, **sampling
            )
            texts = []
            for e, ids, lps, cut in zip(live, out.completion_ids, out.logprobs, out.truncated):
                if not ids:
                    raise RuntimeError(f"the engine returned an empty turn (seed {e.seed})")
                e.extend(list(ids), list(lps), turn)
                e.cut_turns += int(cut)
                texts.append(tok.decode(ids, skip_special_tokens=True))
            called = {}  # index in live -> (calls, results): turns the rollout's tools answer
            if toolset is not None:
                for k, ids in enumerate(out.completion_ids):
                    raw = _raw_text(tok, ids)
                    calls = parse_tool_calls(raw, fmt)
                    if calls:  # the message content: the text outside the calls
                        called[k] = (calls, toolset.run_calls(calls), text_outside_calls(raw, fmt))
            stepping = [k for k in range(len(live)) if k not in called]
            stepped = (  # all stepping envs at once
                runner.step([live[k].env for k in stepping], [texts[k] for k in stepping])
                if stepping
                else []
            )
            results = dict(zip(stepping, stepped))
            for k, (e, ids, cut, text) in enumerate(
                zip(live, out.completion_ids, out.truncated, texts)
            ):
                key = id(e)
                if k in called:
                    calls, answers, text = called[k]
                    tool_log.setdefault(key, []).extend(r.text for r in answers)
                    base_anchor.setdefault(key, e.anchor)
                    new = _record_tool_turn(
                        e, turn, text, calls, answers, cut, invalid_penalty, fmt,
                        (base_anchor[key], *tool_log[key]),
                    )  # fmt: skip
                else:
                    tool_log.pop(key, None)  # the env moves on: a new state to extend
                    base_anchor.pop(key, None)
                    new = _record_turn(e, turn, text, results[k], cut, invalid_penalty)
                    e.replay.append((text, results[k][0]))  # what a fork replays
                if e.end:
                    continue
                if turn + 1 == max_turns:
                    e.end = "max_turns"
                    continue
                eos = ids[-1] if ids[-1] in stops else False  # the sampled end of turn
                if new[0]["role"] == "user":
                    delta = observation_delta_ids(tok, new[0]["content"], eos, tools)
                else:
                    delta = messages_delta_ids(tok, new, eos, tools)
                if len(e) + len(delta) + turn_budget > limit:
                    e.end = "context"
                else:
                    e.extend(delta, None, -1)
        while level < len(branch_at):  # every path ended before these branch points: copies
            episodes = _fork(forker, episodes, branching[level + 1], tool_log, base_anchor)
            level += 1
    finally:
        for env in made:  # a plain class env may have no close()
            getattr(env, "close", lambda: None)()
    rollout = assemble(episodes, tok, max_turns)
    order = {id(env): k for k, env in enumerate(made)}
    rollout.info["env_made"] = [order[id(e.env)] for e in episodes]
    if tree is not None:
        for name, value in tree_fields(episodes, len(branching)).items():
            setattr(rollout, name, value)
    rollout.info["tool_calls"] = [
        sum(len(m.get("tool_calls") or []) for m in e.messages) for e in episodes
    ]  # calls the rollout's tools ran, per episode
    rollout.info["tool_errors"] = [
        sum(m["role"] == "tool" and m["content"].startswith("Error:") for m in e.messages)
        for e in episodes
    ]
    return rollout


def _fork(
    forker: Forker,
    episodes: list[Episode],
    b: int,
    tool_log: dict[int, list[str]],
    base_anchor: dict[int, Hashable],
) -> list[Episode]:
    """Fork every episode into b children (rows stay in tree order); the children inherit their
    parent's tool results so far (the anchors of tool turns)."""
    children = forker.fork(episodes, b)
    for k, parent in enumerate(episodes):  # pop: a dropped parent's id may be reused
        log, anchor = tool_log.pop(id(parent), None), base_anchor.pop(id(parent), None)
        for child in children[k * b : (k + 1) * b]:
            if log is not None:
                tool_log[id(child)] = list(log)
            if anchor is not None:
                base_anchor[id(child)] = anchor
    return children


def _tool_schemas(env: Any, toolset: ToolSet | None) -> list[dict]:
    """The schemas shown to the model: the ToolSet's, then the env's own (`env.tools`)."""
    schemas = list(toolset.schemas()) if toolset is not None else []
    own = _env_attr(env, "tools", None)
    if own:
        names = {s["function"]["name"] for s in schemas}
        clash = names & {s.get("function", {}).get("name") for s in own}
        if clash:
            raise ValueError(f"agent.tools and the env both define the tools {sorted(clash)}")
        schemas += list(own)
    return schemas


def _raw_text(tok: Any, ids: list[int]) -> str:
    """A turn's text with special tokens kept (Mistral's [TOOL_CALLS] is one), minus the special
    tokens that close it (EOS / end-of-turn ids)."""
    special = set(getattr(tok, "all_special_ids", []) or [])
    end = len(ids)
    while end > 0 and ids[end - 1] in special:
        end -= 1
    return tok.decode(ids[:end], skip_special_tokens=False)


def _start_group(
    policy: Any,
    members: list[Episode],
    starts: list[tuple],
    tools: list[dict] | None = None,
    extra_prompt: str = "",
) -> None:
    """Fill one group's episodes from their envs' (obs, info) after reset; fail if they do not
    share one start state. tools: schemas for the template; extra_prompt: a plain-text tool
    listing appended to the env's system prompt."""
    for e, (obs, info) in zip(members, starts):
        obs = valid_utf8(obs) if isinstance(obs, str) else obs
        e.anchor = _anchor(info, obs)
        system = _env_attr(e.env, "system_prompt", "")
        system = "\n\n".join(p for p in (system, extra_prompt) if p)
        e.messages = first_messages(policy.tokenizer, system, obs, tools)
        if (e.messages, e.anchor) != (members[0].messages, members[0].anchor):
            raise ValueError(
                f"envs reset with seed {e.seed} start in different states; group-relative "
                "advantages need every episode of a group to share its start"
            )
        e.log.append(f"### Episode (group {e.group}, seed {e.seed})\n")
        e.log += [f"**{m['role']}**\n\n{_fence(m['content'])}\n" for m in e.messages]
    if tools:
        prompt = prompt_ids(policy.tokenizer, members[0].messages, tools)
    else:
        prompt = policy.encode_prompts([members[0].messages])[0]
    for e in members:
        e.prompt = list(prompt)


def _record_tool_turn(
    e: Episode,
    turn: int,
    text: str,
    calls: list,
    answers: list,
    cut: bool,
    invalid_penalty: float,
    fmt: str,
    anchor: Hashable,
) -> list[dict]:
    """Record a turn whose calls the rollout's tools ran: reward 0 (minus the penalty when a call
    failed), the calls and their `tool` messages; returns those messages."""
    valid = all(r.ok for r in answers)
    reward = 0.0 if valid else -invalid_penalty
    e.invalid += int(not valid)
    e.rewards.append(reward)
    e.anchors.append(e.anchor)
    e.anchor = anchor
    results = tool_messages(calls, [r.text for r in answers], turn, fmt)
    e.messages += [
        {
            "role": "assistant",
            "content": text,
            "tool_calls": assistant_tool_calls(calls, turn, fmt),
        },
        *results,
    ]
    note = ", a tool call failed" if not valid else ""
    note += ", hit the turn token budget" if cut else ""
    e.log.append(f"**assistant** (turn {turn}: reward {reward:+.3f}{note})\n\n{_fence(text)}\n")
    e.log += [f"**tool** ({m['name']})\n\n{_fence(m['content'])}\n" for m in results]
    return results


def _record_turn(
    e: Episode, turn: int, text: str, result: tuple, cut: bool, invalid_penalty: float
) -> list[dict]:
    """Record the env's answer to one turn's text: reward, anchor, messages, log and ending;
    returns the message(s) that follow the assistant turn (the observation)."""
    obs, reward, terminated, truncated, info = result
    obs = valid_utf8(obs) if isinstance(obs, str) else obs
    reward = float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"env returned a non-finite reward {reward} (seed {e.seed}, turn {turn})")
    valid = bool(info.get("valid_action", True))
    if not valid:
        reward -= invalid_penalty
        e.invalid += 1
    e.rewards.append(reward)
    e.anchors.append(e.anchor)
    e.anchor = _anchor(info, obs)
    if info.get("observation_role", "user") == "tool":  # the env ran a tool: its output
        name = str(info.get("tool_name", "tool"))
        following = {"role": "tool", "content": obs, "name": name, "tool_call_id": call_id(turn, 0)}
    else:
        following = {"role": "user", "content": obs}
    e.messages += [{"role": "assistant", "content": text}, following]
    note = ", invalid action" if not valid else ""
    note += ", hit the turn token budget" if cut else ""
    e.log.append(f"**assistant** (turn {turn}: reward {reward:+.3f}{note})\n\n{_fence(text)}\n")
    e.log.append(f"**{following['role']}** (observation)\n\n{_fence(obs)}\n")
    if terminated or truncated:
        e.end = "terminated" if terminated else "env_truncated"
        e.success = bool(info.get("success", False))
    return [following]
