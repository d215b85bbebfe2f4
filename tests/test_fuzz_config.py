"""Property-based tests of the config loader: random YAML text, random schema-shaped mappings and
random dotted overrides give a valid Config or a ConfigError, never another exception.

Each fuzz target has a fixed number of cases (derandomized, so CI sees the same ones) and a
deadline per case; the number of generated cases is printed at the end of the session
("reliability counts", tests/conftest.py). The regression tests pin the bugs this found.
"""

from __future__ import annotations

import warnings

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grouprl.config.loading import Config, ConfigError, load_config, validate
from grouprl.config.rewards import RewardConfig

FUZZ = settings(max_examples=250, deadline=5000, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip

SECTIONS = {
    name: list(getattr(field.annotation, "model_fields", {})) for name, field in
    Config.model_fields.items()
}  # fmt: skip
SECTIONS["rewards"] = list(RewardConfig.model_fields)
FIELDS = sorted({f for fields in SECTIONS.values() for f in fields})
WORDS = ["grpo", "dapo", "gspo", "off", "on", "soft", "hf", "cpu", "auto", "arithmetic", "env",
         "code", "process", "thread", "token", "k3", "linear", "dump", "1e-3", "[", "{a: 1", "~"]  # fmt: skip

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**20), 10**20), st.floats(), st.text(max_size=12),
    st.sampled_from(WORDS),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(FIELDS + ["x"]), inner, max_size=3),
    ),
    max_leaves=8,
)


def section(name: str):
    return st.dictionaries(
        st.sampled_from((SECTIONS[name] or ["x"]) + ["bogus"]), values, max_size=4
    )


mappings = st.fixed_dictionaries(
    {
        "model": st.one_of(section("model"), st.just({"name_or_path": "m"})),
        "task": st.one_of(section("task"), st.just({"name": "arithmetic"})),
    },
    optional={
        k: st.one_of(section(k), values) for k in SECTIONS if k not in ("model", "task", "rewards")
    }
    | {"rewards": st.one_of(st.lists(section("rewards"), max_size=2), values)},
)
LINES = ["run:", "  seed: 1", "model: {name_or_path: m}", "task:", "  name: arithmetic", "- a",
         "algorithm: {preset: [1]}", "algorithm: {preset: dapo}", "rewards: 5", "&a [*a]", "{", ": :",
         "\t", "train: {lr: .nan}", "rollout: {group_size: 1}", "'", "!!python/object:os.system"]  # fmt: skip
documents = st.one_of(
    mappings.map(yaml.safe_dump),
    st.text(max_size=200),
    st.lists(st.sampled_from(LINES), max_size=6).map("\n".join),
)
overrides = st.lists(
    st.one_of(
        st.text(max_size=30),
        st.builds(
            lambda path, value: f"{path}={value}",
            st.lists(st.sampled_from(list(SECTIONS) + FIELDS + ["", "1"]), max_size=3).map(".".join),
            st.one_of(st.text(max_size=10), st.sampled_from(
                ["[1", "{", "null", "[1, 2]", "{a: b}", "1e400", "-", "!!binary x", ".inf"] + WORDS)),
        ),
    ),
    max_size=3,
)  # fmt: skip


def _config_or_config_error(load) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # combination warnings are fine
        try:
            cfg = load()
        except ConfigError as exc:
            assert str(exc)  # a message a person can act on
            return
    assert isinstance(cfg, Config)


@FUZZ
@given(documents, overrides)
def test_fuzz_yaml_text_and_overrides(tmp_path_factory, reliability_counts, doc, items):
    path = tmp_path_factory.getbasetemp() / "fuzz_config.yaml"
    path.write_text(doc, encoding="utf-8", errors="surrogatepass")
    key = "fuzz cases: config loader, YAML text + overrides"
    reliability_counts[key] = reliability_counts.get(key, 0) + 1
    _config_or_config_error(lambda: load_config(path, items))


@FUZZ
@given(mappings, overrides)
def test_fuzz_schema_shaped_mappings(reliability_counts, raw, items):
    from grouprl.config.loading import apply_overrides

    key = "fuzz cases: config loader, schema-shaped mappings + overrides"
    reliability_counts[key] = reliability_counts.get(key, 0) + 1
    _config_or_config_error(lambda: validate(apply_overrides(raw, items)))


# ---- regressions: each of these raised something other than ConfigError before the fix ----------


@pytest.mark.parametrize(
    "text, match",
    [
        ("run:\n\tseed: 1\n", "cannot start any token"),  # yaml ScannerError
        ("model: {name_or_path: m\n", "while parsing a flow mapping"),  # ParserError
        ("x: \x19\n", "special characters are not allowed"),  # ReaderError
        ("model: !!python/object:os.system ls\n", "could not determine a constructor"),
        ("[" * 5000, "not valid YAML"),  # RecursionError in the composer
    ],
)
def test_invalid_yaml_file_is_a_config_error_naming_the_file(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_non_utf8_file_is_a_config_error(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"run: {name: caf\xe9}\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(path)


def test_invalid_yaml_in_an_override_names_the_override():
    with pytest.raises(ConfigError, match=r"override 'train.lr=\[1' is not valid YAML"):
        load_config(None, ["model.name_or_path=m", "task.name=arithmetic", "train.lr=[1"])


@pytest.mark.parametrize("preset", ["[1]", "{a: 1}"])
def test_a_non_string_preset_is_a_config_error(preset):
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config(None, ["model.name_or_path=m", "task.name=arithmetic",
                           f"algorithm.preset={preset}"])  # fmt: skip
