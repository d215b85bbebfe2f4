"""The layering of ARCHITECTURE.md, checked over the imports of every module (static: `ast`).

- objectives import only grouprl.types (pure functions on tensors);
- policies never import workloads or runtime;
- envs never import policies or demos;
- runtime imports no modality code (text / flow policies, workloads, modality rollouts, demos);
- the loop and the runtime never test the modality (model.type, task 'env', the agent / diffusion
  sections): that is the workloads' job;
- the package root holds at most 6 modules.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import grouprl

ROOT = Path(grouprl.__file__).resolve().parent


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every grouprl module (or module.name) imported anywhere in the file, lazily or not."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "grouprl":
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "grouprl")
    return out


GRAPH = {_module(p): _imports(p) for p in ROOT.rglob("*.py")}


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _violations(source: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{mod} imports {imp}"
        for mod, imps in GRAPH.items()
        if _under(mod, source)
        for imp in imps
        if _under(imp, forbidden) and not _under(imp, source)
    )


# modules that know a modality (the runtime must not import them)
MODALITY = (
    "grouprl.policies.text",
    "grouprl.policies.flow",
    "grouprl.workloads",
    "grouprl.demos",
    "grouprl.replicas",
    "grouprl.rollouts.multi_turn",
    "grouprl.rollouts.single_turn",
)

RULES = {
    "objectives import only types": (
        ("grouprl.objectives",),
        # every grouprl module except the objectives themselves and grouprl.types
        tuple(sorted({m for m in GRAPH if m.count(".") == 1} - {"grouprl.types"})),
    ),
    "policies never import workloads or runtime": (
        ("grouprl.policies",),
        ("grouprl.workloads", "grouprl.runtime"),
    ),
    "envs never import policies or demos": (
        ("grouprl.envs",),
        ("grouprl.policies", "grouprl.demos"),
    ),
    "runtime imports no modality code": (("grouprl.runtime",), MODALITY),
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_layering(rule):
    source, forbidden = RULES[rule]
    assert _violations(source, forbidden) == []


def test_the_rules_see_real_imports():
    """The checker itself: the loop imports the workloads, a workload its policy, and a forbidden
    edge added to the graph is reported."""
    assert "grouprl.workloads" in GRAPH["grouprl.train"] or any(
        _under(i, ("grouprl.workloads",)) for i in GRAPH["grouprl.train"]
    )
    assert any(_under(i, ("grouprl.policies.text",)) for i in GRAPH["grouprl.workloads.text"])
    GRAPH["grouprl.objectives.kl"].add("grouprl.policies.text.causal_lm")
    try:
        assert _violations(*RULES["objectives import only types"]) == [
            "grouprl.objectives.kl imports grouprl.policies.text.causal_lm"
        ]
    finally:
        GRAPH["grouprl.objectives.kl"].discard("grouprl.policies.text.causal_lm")


# what deciding the modality looks like in code
MODALITY_TESTS = re.compile(
    r"\bcfg\.model\.type\b|task\.name\s*[!=]=|\bcfg\.(agent|diffusion)\b|is_images|is_agent|"
    r"isinstance\([^)]*(CausalLMPolicy|FlowPolicy)"
)


def test_the_loop_and_the_runtime_never_ask_the_modality():
    files = [ROOT / "train.py", *sorted((ROOT / "runtime").rglob("*.py"))]
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in files
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if MODALITY_TESTS.search(line)
    ]
    assert hits == []


def test_the_package_root_holds_at_most_six_modules():
    modules = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(modules) <= 6, modules
