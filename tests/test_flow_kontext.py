"""FLUX.1 Kontext (FluxKontextPipeline) on its replica (grouprl/replicas/diffusion.py): the
reference image of each example conditions every step, as the pipeline does it.

Checked here: a deterministic chain from given noise equals FluxKontextPipeline's own output
latents for the same image and prompt; the reference's latents are stored with the rollout and
re-scoring uses them (another image changes the log-probs); two training steps through the config
path on a dataset with an image column train the adapter; the options that cannot apply
(model.condition without the image, prompt_image on a text-only pipeline, a missing column) are
errors naming the option.
"""

from functools import partial

import numpy as np
import pytest
import torch
from PIL import Image

from grouprl.config.loading import apply_overrides, validate
from grouprl.policies.flow.models import pack_flux, unpack_flux
from grouprl.policies.flow.steps import run_chain
from grouprl.replicas.diffusion import build_flux_dev, build_flux_kontext_dev
from grouprl.workloads.images.policy import build_flow_policy

SIDE = 32  # generated and reference size: latents 4 x 4 (16 channels), 4 packed tokens each


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("kontext")
    return {
        "kontext": build_flux_kontext_dev(root / "kontext"),
        "dev": build_flux_dev(root / "dev"),
    }


def _image(seed):
    pixels = np.random.RandomState(seed).rand(SIDE, SIDE, 3) * 255
    return Image.fromarray(pixels.astype("uint8"))


def _cfg(out, path, *overrides):
    raw = {
        "run": {"name": "run", "output_dir": str(out), "seed": 0, "device": "cpu",
                "console": False},
        "workload": {"type": "images"},
        "model": {"type": "flow", "name_or_path": str(path), "max_sequence_length": 8,
                  "condition": "prompt_image"},
        "task": {"name": "image_prompts", "options": {"source": "shapes", "n_eval": 2}},
        "rewards": [{"name": "jpeg_compressibility"}],
        "rollout": {"prompts_per_step": 1, "group_size": 2},
        "algorithm": {"preset": "flow_grpo"},
        "diffusion": {"height": SIDE, "width": SIDE, "rollout_steps": 3, "eval_steps": 2,
                      "guidance_scale": 1.0},
        "train": {"steps": 1, "lr": 1e-3},
    }  # fmt: skip
    return validate(apply_overrides(raw, list(overrides)))


@pytest.mark.parametrize("cfg_scale", [1.0, 2.0])  # 2.0: the pipeline's true CFG, "" negative
def test_kontext_chain_equals_the_pipelines_output(tmp_path, folders, cfg_scale):
    """Old code: the Kontext transformer ran as text-to-image FLUX, with no reference image."""
    from diffusers import FluxKontextPipeline

    pol = build_flow_policy(_cfg(tmp_path, folders["kontext"]), "cpu")
    assert pol.family.name == "flux_kontext" and pol.latent_shape == (16, 4, 4)
    image, k_steps = _image(0), 3
    cond = pol.with_reference_images(pol.encode(["a red square"]), [image])
    assert cond.embeds["image_latents"].shape == (1, 16, 4, 4)
    x0 = torch.randn(1, *pol.latent_shape, generator=torch.Generator().manual_seed(0))
    none = torch.zeros(1, k_steps, dtype=torch.bool)  # every step deterministic (Euler)
    latents, _, _ = run_chain(
        partial(pol.predict, pol.model), pol.rules.step, x0, pol.schedule_columns(k_steps, 1),
        cond, torch.full((1,), cfg_scale), none, none, generator=None, chunk=1, store_means=False,
    )  # fmt: skip
    pipe = FluxKontextPipeline.from_pretrained(folders["kontext"])
    out = pipe(image=image, prompt="a red square", height=SIDE, width=SIDE, max_area=SIDE * SIDE,
               num_inference_steps=k_steps, guidance_scale=3.5, max_sequence_length=8,
               latents=pack_flux(x0), output_type="latent", _auto_resize=False,
               true_cfg_scale=cfg_scale, negative_prompt="" if cfg_scale > 1 else None).images  # fmt: skip
    torch.testing.assert_close(latents[:, -1], unpack_flux(out, 4, 4), rtol=1e-5, atol=1e-5)


def test_rescoring_uses_the_stored_reference(tmp_path, folders):
    pol = build_flow_policy(_cfg(tmp_path, folders["kontext"]), "cpu")
    cond = pol.with_reference_images(pol.encode(["a red square"]), [_image(0)])
    r = pol.sample(cond, 2, generator=torch.Generator().manual_seed(0))
    assert torch.equal(pol.log_probs(r.actions).logp[r.mask], r.old_logp[r.mask])
    other = pol.with_reference_images(pol.encode(["a red square"]), [_image(1)]).repeat(2)
    swapped = r.actions.cond.embeds | {"image_latents": other.embeds["image_latents"]}
    batch = type(r.actions)(**{**vars(r.actions), "cond": type(cond)(swapped, other.negative)})
    # the same computation gives exactly 0 (above); the tiny random model's reference shifts each
    # trained step's log-prob by ~1e-4
    assert (pol.log_probs(batch).logp[r.mask] - r.old_logp[r.mask]).abs().min() > 1e-5


def _image_dataset(folder):
    """A local dataset folder with a prompt column and an Image column (what a hub download of an
    editing dataset gives load_dataset)."""
    from datasets import Dataset, Features, Value
    from datasets import Image as ImageFeature

    rows = {"prompt": ["make it red", "make it blue"], "image": [_image(0), _image(1)]}
    features = Features({"prompt": Value("string"), "image": ImageFeature()})
    folder.mkdir()
    Dataset.from_dict(rows, features=features).to_parquet(str(folder / "train.parquet"))
    return folder


def test_kontext_two_training_steps_through_the_config(tmp_path, folders):
    from safetensors.torch import load_file

    from grouprl.runtime.checkpoint import CheckpointManager
    from grouprl.train import train

    data = _image_dataset(tmp_path / "data")
    cfg = _cfg(tmp_path, folders["kontext"], "train.steps=2", "algorithm.kl_coef=0.0",
               f"task.options={{source: hub, path: '{data}', n_eval: 1}}")  # fmt: skip
    train(cfg)
    lora = load_file(CheckpointManager(tmp_path / "run").latest() / "model"
                     / "pytorch_lora_weights.safetensors")  # fmt: skip
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in lora.items())


def test_options_that_cannot_apply_are_errors(tmp_path, folders):
    with pytest.raises(ValueError, match="set model.condition: prompt_image"):
        build_flow_policy(_cfg(tmp_path, folders["kontext"], "model.condition=prompt"), "cpu")
    with pytest.raises(ValueError, match="model.condition='prompt_image' needs an image-cond"):
        build_flow_policy(_cfg(tmp_path, folders["dev"]), "cpu")
    from grouprl.workloads.images.sampling import CONDITIONS

    cfg = _cfg(tmp_path, folders["kontext"])
    pol = build_flow_policy(cfg, "cpu")
    with pytest.raises(ValueError, match="needs an `image` column"):
        CONDITIONS["prompt_image"](cfg, pol, [{"prompt": "a red square"}])
