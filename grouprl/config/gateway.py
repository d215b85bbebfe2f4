"""The `gateway:` section (workload gateway only): the agent program, its rewards, and the limits
of the OpenAI-compatible gateway it talks to (grouprl/rollouts/gateway/)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from grouprl.config.section import Section


class GatewayConfig(Section):
    """Episodes of an agent program run against the gateway, turned into training groups."""

    program: str = Field(
        ...,
        description="The agent program, 'package.module:function' or 'path/to/file.py:function': "
        "called as fn(base_url, episode_id, example) once per episode (rollout.group_size times "
        "per example), it talks to base_url with any OpenAI client, passing episode_id as the "
        "request's `user` field or the X-Episode-Id header, and returns its reward (a number) or "
        "a dict {reward, success?}.",
    )
    reward: Literal["program", "function"] = Field(
        "program",
        description="program: the number the program returns is the episode's reward; function: "
        "`reward_fn` scores the episode (the program's return value is then ignored).",
    )
    reward_fn: str | None = Field(
        None,
        description="With reward: function, 'module:function' or 'file.py:function' called as "
        "fn(example, calls) -> float, calls being the episode's recorded calls (dicts with "
        "messages / prompt, text, finish_reason, weight_version).",
    )
    on_rewrite: Literal["split", "error"] = Field(
        "error",
        description="A call whose prompt does not extend the episode's previous prompt + "
        "completion (the program rewrote or dropped history): error stops the run naming the "
        "episode; split makes every such stretch of calls its own row (same group, same reward).",
    )
    max_episode_tokens: int = Field(
        2048,
        ge=1,
        description="A row's tokens at most (prompt + every call's completion and the messages "
        "between); a call whose prompt + max_tokens would pass it gets a 400 error.",
    )
    concurrency: int = Field(4, ge=1, description="Episodes (program calls) run at once.")
    max_batch: int = Field(
        64,
        ge=1,
        description="Calls of different episodes generated together at most (calls arriving "
        "within 5 ms of each other with the same sampling are one engine batch).",
    )
    episode_timeout_s: float = Field(
        300.0, gt=0, description="Deadline of one episode; a program past it fails the step."
    )
    request_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Deadline of one HTTP request: reading its body, and waiting for the engine "
        "(a busy engine answers 503 after it).",
    )
    tool_format: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        "auto",
        description="How the model writes tool calls, parsed into the response's `tool_calls` "
        "(see agent.tool_format); auto: read off the chat template.",
    )
    model_name: str = Field(
        "grouprl-policy",
        min_length=1,
        description="The model id /v1/models lists; requests naming another model get a 404.",
    )

    @model_validator(mode="after")
    def _reward_fn_iff_function(self) -> GatewayConfig:
        if self.reward == "function" and not self.reward_fn:
            raise ValueError("gateway.reward=function needs gateway.reward_fn ('module:function')")
        if self.reward == "program" and self.reward_fn:
            raise ValueError(
                "gateway.reward_fn is set but gateway.reward=program ignores it; set "
                "gateway.reward=function or remove gateway.reward_fn"
            )
        return self
