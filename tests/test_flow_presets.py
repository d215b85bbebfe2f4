"""Image / video presets: registered with the text ones, resolve into valid configs, set what they claim."""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import pytest
import yaml

from grouprl.config.loading import load_config, validate
from grouprl.config.presets import PRESETS, Preset, preset_settings
from grouprl.config.presets.flow import FLOW_PRESETS
from grouprl.objectives.flow.losses import LIKELIHOOD_FREE
from grouprl.policies.flow.samplers import SAMPLERS

FLOW = [
    "flow_grpo", "flow_grpo_fast", "dance_grpo", "mix_grpo", "ddpo", "diffusion_nft", "awm",
    "branch_grpo",
]  # fmt: skip
MINIMAL = {
    "workload": {"type": "images"},
    "model": {"name_or_path": "x", "type": "flow"},
    "task": {"name": "image_prompts"},
}
TEXT = {
    "workload": {"type": "text"},
    "model": {"name_or_path": "x"},
    "task": {"name": "arithmetic"},
}


def resolve(name: str, **sections) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no preset may trip a combination warning
        return validate({**MINIMAL, **sections, "algorithm": {"preset": name}})


def test_flow_presets_are_registered_after_the_text_ones():
    assert [s["name"] for s in FLOW_PRESETS] == FLOW
    assert list(PRESETS)[-len(FLOW) :] == FLOW
    assert all(isinstance(PRESETS[n], Preset) for n in FLOW)


@pytest.mark.parametrize("name", FLOW)
def test_every_setting_lands_in_the_resolved_config(name):
    preset = PRESETS[name]
    assert preset.arxiv.count(".") == 1 and preset.summary.endswith(".")
    cfg = resolve(name)
    assert "advantage" in preset_settings(name)
    for key, value in preset_settings(name).items():
        got = getattr(cfg.algorithm, key)
        if isinstance(value, Mapping):  # algorithm.surrogate: its type and knobs
            got = {k: getattr(got, k) for k in value}
        assert got == value, (name, key)
    for key, value in preset_settings(name, sections=True).items():
        section, field = key.split(".")
        got = getattr(getattr(cfg, section), field)
        if isinstance(value, Mapping):  # model.lora, typed parts: every key of the mapping
            for sub, want in value.items():
                want = list(want) if isinstance(want, tuple) else want
                assert getattr(got, sub) == want, (name, key, sub)
        else:
            assert got == value, (name, key)
    assert cfg.diffusion.sampler in SAMPLERS


def test_flow_grpo_has_the_paper_defaults():
    cfg = resolve("flow_grpo")
    a, d = cfg.algorithm, cfg.diffusion
    s = a.surrogate
    assert (s.eps_low, s.eps_high, a.kl_coef, s.type, a.scale) == (
        1e-4,
        1e-4,
        0.04,
        "clip",
        "batch",
    )
    assert (d.sampler, d.noise_level, d.rollout_steps, d.eval_steps) == ("flow_sde", 0.7, 10, 40)
    assert (d.adv_clip_max, d.train_steps.type, d.guidance_scale) == (5.0, "all_but_last", 4.5)
    assert (cfg.model.lora.r, cfg.model.lora.alpha) == (32, 64)
    assert cfg.model.lora.target_modules == "attention" and cfg.rollout.group_size == 24


def test_the_siblings_differ_where_their_papers_do():
    fast, dance, mix = resolve("flow_grpo_fast"), resolve("dance_grpo"), resolve("mix_grpo")
    steps = fast.diffusion.train_steps
    assert (steps.type, steps.window_size) == ("random_window", 2)
    assert fast.algorithm.surrogate.eps_high == 1e-5 and fast.algorithm.kl_coef == 0.0
    d = dance.diffusion
    assert (d.sampler, d.eta, d.rollout_steps, d.train_steps.fraction) == (
        "dance_sde", 0.3, 16, 0.6
    )  # fmt: skip
    assert (d.train_steps.type, d.shared_noise, d.shift) == ("random_fraction", "group", 3.0)
    assert (dance.algorithm.scale, dance.algorithm.adv_eps, dance.rollout.group_size) == (
        "group",
        1e-8,
        12,
    )
    m, w = mix.diffusion, mix.diffusion.train_steps
    assert (w.type, w.window_size, w.shift_every, m.rollout_steps) == (
        "sliding_window", 4, 25, 25
    )  # fmt: skip
    ddpo = resolve("ddpo")
    assert (ddpo.diffusion.sampler, ddpo.diffusion.eta, ddpo.diffusion.rollout_steps) == (
        "ddim",
        1.0,
        50,
    )
    assert (ddpo.diffusion.adv_clip_max, ddpo.diffusion.guidance_scale) == (10.0, 5.0)
    assert ddpo.model.lora.target_modules == ["to_q", "to_k", "to_v", "to_out.0"]


def test_likelihood_free_presets_pick_their_objective_and_an_ode_sampler():
    nft, awm = resolve("diffusion_nft"), resolve("awm")
    for cfg, objective in ((nft, "diffusion_nft"), (awm, "awm")):
        assert cfg.diffusion.objective.type == objective and objective in LIKELIHOOD_FREE
        assert (cfg.diffusion.sampler, cfg.diffusion.guidance_scale) == ("ode", 1.0)
        assert cfg.diffusion.train_guidance == "none" and cfg.algorithm.scale == "batch"
    o = nft.diffusion.objective
    assert (nft.algorithm.kl_coef, o.beta, o.ema_decay) == (
        1e-4,
        1.0,
        "nft_ramp",
    )
    d, o = awm.diffusion, awm.diffusion.objective
    assert (awm.algorithm.kl_coef, d.rollout_steps, o.timesteps, o.timestep_fraction) == (
        0.001, 14, 6, 0.9
    )  # fmt: skip
    assert (o.weighting, o.ema_coef, o.ema_decay) == ("ghuber", 1.0, "awm_ramp")


def test_the_users_values_win_and_a_partial_lora_mapping_is_completed():
    with pytest.warns(UserWarning, match=r"cannot apply all its settings.*noise_level=0\.9"):
        cfg = validate(  # the user's values are kept, and the warning names each blocked key
            {**MINIMAL, "diffusion": {"noise_level": 0.9, "guidance_scale": 1.0},
             "rollout": {"group_size": 4},
             "model": {"name_or_path": "x", "type": "flow", "lora": {"r": 8}},
             "algorithm": {"preset": "flow_grpo"}}
        )  # fmt: skip
    assert (cfg.diffusion.noise_level, cfg.diffusion.guidance_scale) == (0.9, 1.0)
    assert cfg.diffusion.rollout_steps == 10 and cfg.rollout.group_size == 4
    assert (cfg.model.lora.r, cfg.model.lora.alpha) == (8, 64)  # the rest from the preset
    assert cfg.model.lora.target_modules == "attention"
    with pytest.warns(UserWarning, match=r"model\.lora=None"):
        full = validate(
            {**MINIMAL, "model": {"name_or_path": "x", "type": "flow", "lora": None},
             "algorithm": {"preset": "flow_grpo"}}
        )  # fmt: skip
    assert full.model.lora is None  # null = full fine-tuning, not overridden


def test_a_text_preset_leaves_the_diffusion_section_alone():
    assert resolve("grpo").diffusion == resolve("dapo").diffusion
    assert resolve("grpo").model.lora is None


def test_a_flow_preset_in_a_text_config_fills_no_diffusion_section():
    with pytest.warns(UserWarning, match=r"sets diffusion\.objective.*workload 'text' does not"):
        cfg = validate({**TEXT, "algorithm": {"preset": "flow_grpo"}})
    assert cfg.diffusion is None and "diffusion" not in cfg.model_dump()
    assert cfg.algorithm.surrogate.eps_high == 1e-4  # the algorithm part still applies


def test_preset_values_are_read_only():
    lora = PRESETS["flow_grpo"].settings["model.lora"]
    with pytest.raises(TypeError):
        lora["r"] = 4  # type: ignore[index]
    with pytest.raises(TypeError):
        PRESETS["flow_grpo"].settings["kl_coef"] = 0.2  # type: ignore[index]


def test_yaml_and_overrides_with_a_flow_preset(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({**MINIMAL, "algorithm": {"preset": "dance_grpo"}}))
    cfg = load_config(path, ["diffusion.eta=0.25", "diffusion.height=32", "diffusion.width=32"])
    assert (cfg.diffusion.eta, cfg.diffusion.height, cfg.diffusion.sampler) == (
        0.25,
        32,
        "dance_sde",
    )
