"""Shared pytest fixtures (stable names; other test files rely on them).

- `tiny_model_dir`: path (pathlib.Path) of a saved tiny Qwen2 + char tokenizer
  (grouprl.policies.text.tiny.save_tiny with default sizes, seed 0); session-scoped, read-only by convention.
- `tiny_tokenizer`: a fresh `char_tokenizer()` (function-scoped, cheap).
- `tiny_model`: a fresh fp32 `tiny_qwen2(char_tokenizer())` in eval mode (function-scoped, seed 0).
- `replica`: `get(name) -> folder` of grouprl.replicas' `name`, built once per test module.

Tests use one intra-op thread: the models are tiny, and on a small shared CPU extra threads
mostly spin against each other (a 64-wide matmul got ~50x slower under load with 2 threads).
"""

from __future__ import annotations

import pytest
import torch

from grouprl.policies.text.tiny import char_tokenizer, save_tiny, tiny_qwen2

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture
def tiny_tokenizer():
    return char_tokenizer()


@pytest.fixture
def tiny_model(tiny_tokenizer):
    return tiny_qwen2(tiny_tokenizer)


# ---- reliability counts (fuzz targets, hostile snippets): printed once at the end of the session
_RELIABILITY_COUNTS: dict[str, int] = {}


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    """get(name) -> the folder of replica `name` (grouprl.replicas.build_replica), built on first
    use and shared by the module's tests."""
    from grouprl.replicas import build_replica

    made = {}

    def get(name):
        if name not in made:
            made[name] = build_replica(name, tmp_path_factory.mktemp(name.replace(".", "_")))
        return made[name]

    return get


@pytest.fixture(scope="session")
def reliability_counts() -> dict[str, int]:
    """A session-wide dict, name -> count (e.g. hypothesis cases generated per fuzz target, hostile
    snippets tried / contained); tests add to it and `pytest_terminal_summary` prints it."""
    return _RELIABILITY_COUNTS


def pytest_terminal_summary(terminalreporter) -> None:
    if _RELIABILITY_COUNTS:
        terminalreporter.section("reliability counts")
        for name, count in sorted(_RELIABILITY_COUNTS.items()):
            terminalreporter.line(f"{name}: {count}")
