"""The architecture sweep (grouprl/replicas/sweep/) and its support matrix.

- a fast subset of architectures through the real checks agrees with the committed matrix
  (dense, MoE, fused projections, soft-capping + sliding window, Conv1D heads, one VLM);
- the tiny-config rules (field roles, per-layer lists, mrope sections);
- the LoRA coverage rule classifies a real module tree;
- the committed matrix's schema and check names are the sweep's, and docs/support_matrix.md is
  what the JSON renders;
- the matrix refuses / warns by name when a config is read (model.support_check);
- the whole sweep (slow).
"""

from __future__ import annotations

import json
import warnings

import pytest

from grouprl.config.loading import validate
from grouprl.policies import support
from grouprl.replicas.sweep import matrix as mx
from grouprl.replicas.sweep.checks import CHECKS, check_architecture, module_kinds
from grouprl.replicas.sweep.tiny import shrink, tiny_config

# (kind, model type): what each row shows
SUBSET = [
    ("causal_lm", "qwen2"),  # dense, GQA, tied head
    ("causal_lm", "mixtral"),  # MoE with fused expert parameters, sliding window
    ("causal_lm", "phi3"),  # fused qkv_proj / gate_up_proj
    ("causal_lm", "gemma2"),  # final-logit soft-capping, alternating sliding window
    ("causal_lm", "gpt2"),  # Conv1D projections, learned absolute positions
    ("image_text_to_text", "llava"),  # a VLM through the VLM policy
]


@pytest.fixture(scope="module")
def committed():
    m = mx.load_matrix()
    assert m is not None, "grouprl/replicas/support_matrix.json is missing"
    return m


@pytest.mark.parametrize("kind,model_type", SUBSET, ids=[t for _, t in SUBSET])
def test_subset_runs_the_real_checks_and_agrees_with_the_committed_matrix(
    kind, model_type, committed
):
    res = check_architecture(kind, model_type)
    assert list(res) == list(CHECKS)
    assert res["build"]["status"] == "pass", res["build"]
    # nothing crashed inside the harness: a failure is a finding with its reason
    assert all(r["status"] in mx.STATUSES and (r["status"] != "fail" or r["reason"])
               for r in res.values())  # fmt: skip
    # vllm is optional (run with --vllm only, as the committed matrix may have for this row)
    assert res["vllm"]["status"] == "skip"
    got = {c: r["status"] for c, r in res.items() if c != "vllm"}
    row = committed["rows"][kind][model_type]
    want = {c: r["status"] for c, r in row["checks"].items() if c != "vllm"}
    assert got == want, (
        f"{model_type}: the checks now give {got}, the committed matrix {want}; regenerate it "
        f"with `python -m grouprl.replicas sweep --only {model_type}`"
    )


def test_tiny_config_reads_the_field_roles():
    d = shrink({
        "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 14336, "num_hidden_layers": 6,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 262144,
        "image_token_id": 255999, "sliding_window": 4096,
        "rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24]},
        "text_config": {"hidden_size": 2048, "num_attention_heads": 16,
                        "num_key_value_heads": 16, "num_hidden_layers": 24},
    })  # fmt: skip
    assert (d["hidden_size"], d["num_attention_heads"], d["num_key_value_heads"]) == (128, 4, 2)
    assert (d["head_dim"], d["intermediate_size"]) == (32, 256)
    # the shortest prefix holding every kind of layer: 5 sliding then the full one
    assert d["num_hidden_layers"] == 6 and d["layer_types"][-1] == "full_attention"
    assert (d["num_local_experts"], d["num_experts_per_tok"]) == (4, 2)
    assert d["vocab_size"] == 256000  # holds the image token id
    assert d["sliding_window"] == 8
    assert d["rope_parameters"]["mrope_section"] == [4, 6, 6]  # sums to head_dim / 2
    t = d["text_config"]
    assert (t["hidden_size"], t["num_key_value_heads"], t["num_hidden_layers"]) == (128, 4, 2)


def test_tiny_config_builds_a_config_of_the_real_class():
    cfg = tiny_config("mixtral")
    assert type(cfg).__name__ == "MixtralConfig"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_local_experts) == (128, 2, 4)


def test_lora_coverage_classifies_the_module_tree():
    from grouprl.replicas.sweep.checks import build

    model = build("causal_lm", "qwen2")
    could, got = module_kinds(model, {id(model.get_output_embeddings())})
    # q, k, v, o of 2 layers under Qwen2Attention; gate, up, down under Qwen2MLP
    assert could == {"attention": 8, "mlp": 6} and got == {}


def test_committed_matrix_has_the_sweeps_schema_and_checks(committed):
    assert committed["schema"] == mx.SCHEMA
    assert committed["checks"] == {k: list(v) for k, v in mx.KIND_CHECKS.items()}
    for key in ("versions", "date", "machine", "command", "sweep_seconds"):
        assert key in committed["meta"], key
    for kind, rows in committed["rows"].items():
        for name, row in rows.items():
            assert set(row["checks"]) == set(mx.KIND_CHECKS[kind]), (kind, name)
            assert all(r["status"] in mx.STATUSES for r in row["checks"].values()), (kind, name)
    assert committed["totals"] == mx.totals(committed["rows"])


def test_docs_support_matrix_is_what_the_json_renders(committed):
    assert mx.DOCS_MD.read_text() == mx.render_markdown(committed), (
        "docs/support_matrix.md is not what support_matrix.json renders; rerun the sweep"
    )


def test_registered_causal_lms_are_all_rows(committed):
    from transformers.models.auto import modeling_auto

    assert set(committed["rows"]["causal_lm"]) == set(
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    )
    assert set(committed["rows"]["image_text_to_text"]) == set(
        modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    )


# ---- the matrix when a config is read ----------------------------------------------------------


def _row(arch, **status):
    checks = {c: {"status": "pass", "reason": ""} for c in CHECKS}
    for c, reason in status.items():
        checks[c] = {"status": "fail", "reason": reason}
    return {"architecture": arch, "checks": checks, "seconds": 1.0}


@pytest.fixture
def matrix(tmp_path, monkeypatch):
    rows = {
        "gemma2": _row("Gemma2ForCausalLM", scoring="differs by 2e-05"),
        "phi3": _row("Phi3ForCausalLM", lora="no adapter on the mlp modules"),
        "qwen2": _row("Qwen2ForCausalLM"),
    }
    m = mx.build_matrix({("causal_lm", k): v for k, v in rows.items()},
                        {"versions": {"transformers": "9.9.9"}})  # fmt: skip
    path = tmp_path / "matrix.json"
    path.write_text(json.dumps(m))
    monkeypatch.setattr(support, "MATRIX_JSON", path)
    return path


def _config(tmp_path, arch, **model):
    folder = tmp_path / arch
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": "x"}))
    raw = {"workload": {"type": "text"}, "task": {"name": "arithmetic"},
           "model": {"name_or_path": str(folder), **model}}  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate(raw)
    return [str(w.message) for w in caught if "support matrix" in str(w.message)]


def test_a_failed_scoring_check_is_refused_by_name(tmp_path, matrix):
    with pytest.raises(Exception, match=r"Gemma2ForCausalLM.*scoring.*2e-05.*support_check"):
        _config(tmp_path, "Gemma2ForCausalLM")


def test_support_check_warn_turns_the_refusal_into_a_warning(tmp_path, matrix):
    msgs = _config(tmp_path, "Gemma2ForCausalLM", support_check="warn")
    assert len(msgs) == 1 and "Gemma2ForCausalLM" in msgs[0] and "scoring" in msgs[0]


def test_a_failed_lora_check_warns_only_under_lora(tmp_path, matrix):
    assert _config(tmp_path, "Phi3ForCausalLM") == []
    msgs = _config(tmp_path, "Phi3ForCausalLM", lora={"r": 4})
    assert len(msgs) == 1 and "Phi3ForCausalLM" in msgs[0] and "lora" in msgs[0]


def test_an_architecture_absent_from_the_matrix_warns_with_the_version(tmp_path, matrix):
    msgs = _config(tmp_path, "BrandNewForCausalLM")
    assert len(msgs) == 1
    assert "BrandNewForCausalLM is not in the support matrix of transformers 9.9.9" in msgs[0]


def test_support_check_off_consults_nothing_and_passing_rows_are_silent(tmp_path, matrix):
    assert _config(tmp_path, "Gemma2ForCausalLM", support_check="off") == []
    assert _config(tmp_path, "Qwen2ForCausalLM") == []


@pytest.mark.slow
def test_the_whole_sweep_writes_a_complete_matrix(tmp_path):
    from grouprl.replicas.sweep import main

    assert main(["--jobs", "2", "--out", str(tmp_path)]) == 0
    m = json.loads((tmp_path / "support_matrix.json").read_text())
    assert (tmp_path / "support_matrix.md").read_text() == mx.render_markdown(m)
    assert m["totals"]["causal_lm"]["rows"] == len(m["rows"]["causal_lm"]) > 100
    assert all(r["checks"]["build"]["status"] != "skip" for r in m["rows"]["causal_lm"].values())
