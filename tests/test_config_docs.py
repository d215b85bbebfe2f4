"""The config explains itself (issue 16 item 5): `grouprl config show`, `grouprl train --help`, the
README's option tables generated from the models (and a drift check), the JSON schema in the run
directory. The walker is tested on a toy model with every shape the config uses or will use
(nested section, list of sections, discriminated union, Literal, Optional, bounds)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

import jsonschema
import pytest
import yaml
from pydantic import BaseModel, Field
from tiny_runs import arithmetic_run

from grouprl.cli import main
from grouprl.config import docs
from grouprl.config.loading import Config, validate

ROOT = Path(__file__).resolve().parents[1]


class _Clip(BaseModel):
    type: Literal["clip"] = "clip"
    eps_low: float = Field(0.2, ge=0, description="Lower clip range.")


class _Sapo(BaseModel):
    type: Literal["sapo"] = "sapo"
    tau_pos: float = Field(1.0, gt=0, description="Gate temperature for A > 0.")


class _Inner(BaseModel):
    """An inner section."""

    sleep: Literal["off", "level1"] = Field("off", description="Sleep mode.")


class _Item(BaseModel):
    name: str = Field(..., description="Item name.")


class _Toy(BaseModel):
    surrogate: Annotated[_Clip | _Sapo, Field(discriminator="type")] = Field(
        default_factory=_Clip, description="The surrogate."
    )
    inner: _Inner = Field(default_factory=_Inner)
    maybe: _Inner | None = Field(None, description="Optional section.")
    items: list[_Item] = Field(default_factory=list, description="A list of sections.")
    size: int | None = Field(None, ge=1, le=8, description="A bounded size.")
    sinks: list[Literal["a", "b"]] = Field(default_factory=lambda: ["a"], description="Sinks.")
    # the shapes a discriminated config may also take: optional, in a list, no explicit discriminator
    extra: Annotated[_Clip | _Sapo, Field(discriminator="type")] | None = Field(
        None, description="Optional union."
    )
    steps: list[Annotated[_Clip | _Sapo, Field(discriminator="type")]] = Field(
        default_factory=list, description="A list of variants."
    )
    plain: _Clip | _Sapo = Field(default_factory=_Sapo, description="Union, no discriminator.")


def test_options_walk_unions_sections_lists_literals_and_bounds():
    rows = {(r.key, r.when): r for r in docs.options(_Toy)}
    union = rows[("surrogate", "")]
    assert union.section and union.allowed == ("clip", "sapo")
    assert union.default == "{type: clip}" and "chosen by surrogate.type" in union.type
    eps = rows[("surrogate.eps_low", "surrogate.type=clip")]
    assert (eps.type, eps.default, eps.description) == ("float (>= 0)", "0.2", "Lower clip range.")
    assert rows[("surrogate.tau_pos", "surrogate.type=sapo")].type == "float (> 0)"
    assert ("surrogate.tau_pos", "surrogate.type=clip") not in rows  # each variant: its own fields
    assert rows[("inner", "")].description == "An inner section."  # the class docstring
    assert rows[("inner.sleep", "")].allowed == ("off", "level1")
    assert rows[("inner.sleep", "")].default == '"off"'
    assert rows[("maybe", "")].type == "section or null" and rows[("maybe", "")].default == "null"
    assert rows[("items", "")].type == "list of sections"
    assert rows[("items[].name", "")].default == "required"
    assert rows[("size", "")].type == "int | null (>= 1, <= 8)"
    assert rows[("sinks", "")].allowed == ("a", "b") and rows[("sinks", "")].default == '["a"]'
    assert rows[("extra", "")].allowed == ("clip", "sapo") and rows[("extra", "")].default == "null"
    assert "or null" in rows[("extra", "")].type
    assert ("extra.tau_pos", "extra.type=sapo") in rows
    assert rows[("steps[]", "")].allowed == ("clip", "sapo")
    assert ("steps[].eps_low", "steps[].type=clip") in rows
    assert rows[("plain", "")].default == "{type: sapo}"  # the Literal field all variants share
    assert ("plain.eps_low", "plain.type=clip") in rows


def test_select_a_section_and_reject_an_unknown_one_naming_the_valid():
    assert [r.key for r in docs.select("inner", _Toy)] == ["inner", "inner.sleep"]
    assert [r.key for r in docs.select("items", _Toy)] == ["items", "items[].name"]
    with pytest.raises(ValueError, match=r"unknown config section 'innr'.*inner, maybe"):
        docs.select("innr", _Toy)


def test_config_show_prints_every_field_of_a_section(capsys):
    assert main(["config", "show", "rollout.vllm"]) == 0
    out = capsys.readouterr().out
    vllm = type(
        Config.model_fields["rollout"].default_factory().vllm
    )  # the model, wherever it lives
    for name in vllm.model_fields:
        assert f"rollout.vllm.{name}:" in out
    assert 'rollout.vllm.sleep: off | level1 | level2 = "off"' in out
    assert "rollout.vllm.gpu_memory_utilization: float (> 0, <= 1) = 0.3" in out
    assert "    Share of GPU memory vLLM takes" in out  # the description, indented
    assert "rollout.engine" not in out  # only the section asked for


def test_config_show_without_a_section_covers_every_field(capsys):
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    keys = {line.split(":")[0] for line in out.splitlines() if not line.startswith(" ")}
    expected = {"model.name_or_path", "algorithm.advantage", "diffusion.sampler", "train.lr",
                "rewards[].timeout_s", "model.lora.r", "checkpoint.keep_last"}  # fmt: skip
    assert expected <= keys
    assert keys == {r.key for r in docs.options(Config)}


def test_config_show_unknown_section_is_an_error_listing_the_valid_ones(capsys):
    assert main(["config", "show", "rollot"]) == 2
    err = capsys.readouterr().err
    assert "unknown config section 'rollot'" in err
    assert "rollout, algorithm" in err and "rollout.vllm" in err


def test_train_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for row in docs.options(Config):
        if not row.section:
            assert f"  {row.key} " in out, row.key
    assert "algorithm.advantage" in out and "grpo | dr_grpo | rloo" in out


@pytest.mark.parametrize("command", [["config", "show", "--help"], ["list", "--help"],
                                     ["bench", "--help"], ["--help"]])  # fmt: skip
def test_every_subcommand_has_help(capsys, command):
    with pytest.raises(SystemExit):
        main(command)
    out = capsys.readouterr().out
    assert out.startswith("usage: grouprl") and len(out.splitlines()) > 5


def test_readme_option_tables_match_the_models():
    """Fails when a config field changes without `python -m grouprl.config.docs --write README.md`."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "<!-- options:algorithm -->" in text and "<!-- options-overview -->" in text
    assert docs.render(text) == text, "run: python -m grouprl.config.docs --write README.md"
    # every top-level section has its table (its own block or one in the options-rest block)
    assert "<!-- options-rest -->" in text
    for name in Config.model_fields:
        assert f"<!-- options:{name} -->" in text or f"<code>{name}</code>" in text, name


def test_a_section_added_to_the_config_gets_its_table_from_regeneration_alone():
    class _Bigger(BaseModel):
        old: _Inner = Field(default_factory=_Inner)
        new: _Clip = Field(default_factory=_Clip, description="A section added later.")

    text = "<!-- options:old -->\n<!-- /options -->\n<!-- options-rest -->\n<!-- /options -->\n"
    out = docs.render(text, _Bigger)
    assert "<details><summary><code>new</code></summary>" in out and "| `eps_low` |" in out
    assert "<code>old</code>" not in out  # it has its own block
    assert docs.render(out, _Bigger) == out  # regenerating is stable


def test_render_replaces_a_stale_table_and_check_reports_it(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- options:rollout.vllm -->\n| stale |\n<!-- /options -->\nend\n")
    assert docs.main(["--check", str(doc)]) == 1
    assert docs.main(["--write", str(doc)]) == 0
    text = doc.read_text()
    assert "| stale |" not in text and "| `sleep` | `off` / `level1` / `level2` |" in text
    assert text.startswith("intro\n") and text.endswith("<!-- /options -->\nend\n")
    assert docs.main(["--check", str(doc)]) == 0


def test_the_run_directory_holds_the_config_schema(tmp_path, tiny_model_dir):
    from grouprl.train import train

    train(validate(arithmetic_run(tmp_path, tiny_model_dir)))
    run_dir = tmp_path / "run"
    schema = json.loads((run_dir / "config.schema.json").read_text())
    assert schema == Config.model_json_schema()
    # the resolved config the run wrote validates against it; a wrong value does not
    resolved = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())
    jsonschema.validate(resolved, schema)
    resolved["rollout"]["engine"] = "nope"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(resolved, schema)
