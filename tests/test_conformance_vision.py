"""Vision-language conformance (issue 17, item 6), in the manner of test_conformance_text.py.

1. Every VLM replica (Qwen2-VL, Qwen2.5-VL, LLaVA-1.5; grouprl/replicas/vision.py) runs through
   the VLM policy: the fast engine's sampled tokens carry the log-probs transformers' own forward
   of the model (with the pixel inputs) gives them, and the policy's saved folder loads in
   transformers (the merged weights) and peft (the LoRA adapter on the replica) with the same
   log-probs.
2. Every shipped config under configs/vlm/ runs 2 steps on the replica of its model through the
   real entry point (`grouprl train`), in the config's own dtype, on a small local dataset with
   the columns of the config's hub dataset (a parquet file with a `datasets` Image feature,
   written here); only sizes, the model path, the device, the engine (vLLM configs: the fast
   engine; vLLM is a GPU build there) and the data source are overridden. Every saved tensor is
   finite, and the checkpoint loads in transformers (and its adapter in peft) with the log-probs
   of the policy the run trained; a new run starts from the checkpoint folder.
3. The policy's LLaVA prompt encoding is transformers' LlavaProcessor's, and no engine samples
   the image placeholder, even where the model favours it (a sampled placeholder would make the
   scoring forward fail on the image-feature count).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image, ImageDraw
from safetensors import safe_open

import grouprl.train as train_mod
from grouprl.cli import main
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.policies.vision.policy import VisionLMPolicy

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SIZES = [
    "train.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
    "rollout.max_new_tokens=8", "eval.every=0", "eval.max_examples=2", "eval.pass_k=0",
    "eval.batch_size=4", "checkpoint.every=0", "run.console=false", "run.device=cpu",
    "train.micro_batch_size=2", "train.lr=0.01",  # lr: 2 steps must move the log-probs visibly
]  # fmt: skip
LOCAL = [  # the hub dataset replaced by the local parquet file written by the test
    "task.options.source={data}", "task.options.split=null", "task.options.eval_split=null",
    "task.options.eval_fraction=0.34",
]  # fmt: skip


# --------------------------------------------------------------------------- helpers
def _figure(colour: tuple[int, int, int], size: int = 56) -> Image.Image:
    """A geometry-style diagram: a triangle outline on white."""
    image = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(image).polygon([(6, 48), (50, 48), (28, 8)], outline=colour, width=2)
    return image


def _prompt(question: str, *colours: tuple[int, int, int]) -> list[dict]:
    items = [{"type": "image", "image": _figure(c)} for c in colours]
    return [{"role": "user", "content": [*items, {"type": "text", "text": question}]}]


PROMPTS = [
    _prompt("Find x.", (200, 0, 0)),
    _prompt("Which angle is larger?", (0, 0, 200), (0, 150, 0)),
]


def hf_logprobs(model, batch) -> torch.Tensor:
    """Completion log-probs [N, T] of a transformers / peft image-text-to-text model: each row
    alone, [prompt | completion] through the model's own forward with the row's pixel inputs,
    the image / video placeholder tokens out of the action space (the policy never samples them)."""
    image_id = model.config.image_token_id
    banned = [image_id] + [v for v in [getattr(model.config, "video_token_id", None)] if v]
    qwen = model.config.model_type.startswith("qwen")
    out = torch.zeros(batch.completion_ids.shape)  # [N, T]
    for i in range(len(batch.completion_ids)):
        p = batch.prompt_ids[i][batch.prompt_mask[i]].tolist()
        c = batch.completion_ids[i][batch.completion_mask[i]].tolist()
        ids = torch.tensor([p + c])  # [1, P + T]
        extra = {"mm_token_type_ids": (ids == image_id).int()} if qwen else {}
        vision = {k: v.to(model.dtype) if v.is_floating_point() else v
                  for k, v in batch.vision[i].items()}  # fmt: skip
        with torch.no_grad():
            logits = (
                model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra, **vision)
                .logits[0, len(p) - 1 : -1]
                .float()
            )  # [T, V]
        logits[:, banned] = float("-inf")
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
        out[i, : len(c)] = lp
    return out


def _sharpen(policy: VisionLMPolicy) -> None:
    """Random replica weights give near-uniform logits; scaled, samples and scores differ."""
    with torch.no_grad():
        for p in policy.model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)


# --------------------------------------------------------------------------- 1. replicas
@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "llava"])
def test_replica_runs_through_the_vlm_policy_and_its_save_loads(family, replica, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    folder = replica(family)
    policy = VisionLMPolicy.from_pretrained(str(folder), lora={"r": 4, "alpha": 8})
    _sharpen(policy)
    torch.manual_seed(0)
    rollout = policy.sample(PROMPTS, 2, SamplingParams(max_new_tokens=4))
    batch = rollout.actions
    policy.model.eval()
    want = hf_logprobs(policy.model, batch) * batch.completion_mask
    assert torch.allclose(rollout.engine_logp * batch.completion_mask, want, atol=1e-4)
    ours = policy.log_probs(batch, with_entropy=False).logp.detach() * batch.completion_mask
    assert torch.allclose(ours, want, atol=1e-4)
    with torch.no_grad():  # move the adapter off zero so that the saved folder carries it
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    ours = policy.log_probs(batch, with_entropy=False).logp.detach() * batch.completion_mask
    out = policy.save_pretrained(tmp_path / "saved")
    merged = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    assert type(merged).__name__ == type(policy.model.get_base_model()).__name__
    assert torch.allclose(hf_logprobs(merged, batch) * batch.completion_mask, ours, atol=1e-4)
    base = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    _sharpen_model(base)
    adapted = PeftModel.from_pretrained(base, out / "adapter").eval()
    assert torch.allclose(hf_logprobs(adapted, batch) * batch.completion_mask, ours, atol=1e-4)


def test_llava_prompt_ids_are_the_transformers_processors(replica):
    """The policy's encoding of a chat prompt with an image = transformers' LlavaProcessor's
    (input ids with the image expanded and the <s> the processor adds, pixel values)."""
    from transformers import AutoProcessor

    folder = replica("llava")
    policy = VisionLMPolicy.from_pretrained(str(folder))
    ours = policy.processor.encode(PROMPTS[1])
    real = AutoProcessor.from_pretrained(folder).apply_chat_template(
        PROMPTS[1], add_generation_prompt=True, tokenize=True, return_dict=True,
        return_tensors="pt",
    )  # fmt: skip
    assert torch.equal(ours.vision["pixel_values"], real["pixel_values"])
    assert ours.token_ids == real["input_ids"][0].tolist()


@pytest.mark.parametrize("family", ["qwen2-vl", "llava"])
def test_sampled_completions_never_hold_the_image_placeholder(family, replica):
    """The LM head's logit of the image placeholder is raised by 30 (as an under-trained model
    can favour it): the engine must still never emit it, and the sampled rows must score."""
    policy = VisionLMPolicy.from_pretrained(str(replica(family)))
    image_id = policy.model.config.image_token_id

    def favour_placeholder(module, inputs, logits):  # [..., V]
        logits = logits.clone()
        logits[..., image_id] += 30.0
        return logits

    policy.model.get_output_embeddings().register_forward_hook(favour_placeholder)
    torch.manual_seed(0)
    batch = policy.sample(PROMPTS, 2, SamplingParams(max_new_tokens=4)).actions
    assert int((batch.completion_ids[batch.completion_mask] == image_id).sum()) == 0
    policy.log_probs(batch, with_entropy=False)


def _sharpen_model(model) -> None:
    """The same scaling as _sharpen, on a freshly loaded base model (the adapter goes on it)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)


# --------------------------------------------------------------------------- 2. configs
@dataclass
class Case:
    config: str
    family: str
    columns: str | None  # the layout of the config's hub dataset (None: a built-in task)
    overrides: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return Path(self.config).stem


CASES = [
    Case(
        "vlm/qwen2.5-vl-3b-geometry-lora.yaml",
        "qwen2.5-vl",
        "geometry3k",
        [*LOCAL, "rollout.engine=fast"],
    ),  # fmt: skip
    # random replicas score 0 on every sample; an entropy term gives these GRPO runs a gradient
    Case(
        "vlm/qwen2-vl-2b-chartqa-full.yaml",
        "qwen2-vl",
        "chartqa",
        [*LOCAL, "algorithm.entropy_coef=0.1"],
    ),
    Case(
        "vlm/shapes_demo.yaml",
        "qwen2-vl",
        None,
        ["task.options.n_train=8", "task.options.n_eval=2", "algorithm.entropy_coef=0.1"],
    ),
]
# the VLM demo's config runs on the Qwen2-VL replica in tests/test_vlm_train.py
OTHER = {"vlm/shapes_demo.yaml"}


def test_every_shipped_vlm_config_has_a_case():
    shipped = {p.relative_to(ROOT / "configs").as_posix()
               for p in (ROOT / "configs" / "vlm").glob("*.yaml")}  # fmt: skip
    assert shipped == {c.config for c in CASES} | OTHER


def _needs_vlm_workload_and_vqa_task() -> None:
    import grouprl.workloads  # noqa: F401  (registers the built-in workloads)
    from grouprl.envs.tasks import TASKS
    from grouprl.workloads.base import WORKLOADS

    missing = [n for n, ok in (("workload vlm", "vlm" in WORKLOADS), ("task vqa", "vqa" in TASKS))
               if not ok]  # fmt: skip
    if missing:
        pytest.skip(f"this checkout has no {' / '.join(missing)}")


def write_dataset(layout: str, path: Path) -> Path:
    """A parquet file with a `datasets` Image feature in the hub dataset's own columns:
    geometry3k: images (a list of images), problem (with an <image> placeholder), answer;
    chartqa: image, query, label (a list of accepted answers)."""
    from datasets import Dataset, Features, Sequence, Value
    from datasets import Image as ImageFeature

    colours = [(200, 0, 0), (0, 0, 200), (0, 150, 0), (120, 0, 120), (0, 0, 0), (200, 120, 0)]
    figures = [_figure(c) for c in colours]
    if layout == "geometry3k":
        questions = [f"<image>Find x if the angle is {10 * k} degrees." for k in range(1, 7)]
        data = {"images": [[f] for f in figures], "problem": questions,
                "answer": [str(10 * k) for k in range(1, 7)]}  # fmt: skip
        features = Features({"images": Sequence(ImageFeature()), "problem": Value("string"),
                             "answer": Value("string")})  # fmt: skip
    else:
        data = {"image": figures, "query": [f"What is bar {k}?" for k in range(6)],
                "label": [[str(k)] for k in range(6)]}  # fmt: skip
        features = Features({"image": ImageFeature(), "query": Value("string"),
                             "label": Sequence(Value("string"))})  # fmt: skip
    Dataset.from_dict(data, features=features).to_parquet(str(path))
    return path


def saved_tensors(run_dir: Path):
    for path in sorted(run_dir.rglob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                yield f"{path.relative_to(run_dir)}:{key}", f.get_tensor(key)


def run_config(case: Case, model: Path, out: Path, data: Path, monkeypatch, *extra: str):
    """`grouprl train CONFIG overrides` in this process; returns (run dir, trained policy)."""
    trained = []
    real = train_mod.build_policy

    def keep(cfg, device):  # the run's own policy object, to compare with what it saved
        trained.append(real(cfg, device))
        return trained[-1]

    monkeypatch.setattr(train_mod, "build_policy", keep)
    monkeypatch.setenv("GROUPRL_DEBUG", "1")  # errors propagate with their type and traceback
    overrides = [o.format(data=data) for o in case.overrides]
    rc = main(["train", str(ROOT / "configs" / case.config), f"model.name_or_path={model}",
               f"run.output_dir={out}", *SIZES, *overrides, *extra])  # fmt: skip
    assert rc == 0
    run_dir = next(p.parent for p in out.rglob("config.yaml"))
    return run_dir, trained[-1]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_vlm_config_runs_on_its_replica_and_the_checkpoint_loads(
    case, replica, tmp_path, monkeypatch
):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    _needs_vlm_workload_and_vqa_task()
    base = replica(case.family)
    data = case.columns and write_dataset(case.columns, tmp_path / f"{case.columns}.parquet")
    run_dir, policy = run_config(case, base, tmp_path / "out", data, monkeypatch)
    cfg = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())
    assert cfg["model"]["type"] == "vlm"
    dtype = DTYPES[cfg["model"]["dtype"]]
    bad = [n for n, t in saved_tensors(run_dir)
           if t.is_floating_point() and not torch.isfinite(t).all()]  # fmt: skip
    assert not bad, f"non-finite saved tensors: {bad[:5]}"
    ckpt = max((run_dir / "checkpoints").glob("step-*"))
    assert ckpt.name == "step-00000002"
    torch.manual_seed(0)
    batch = policy.sample(PROMPTS, 2, SamplingParams(max_new_tokens=4)).actions
    policy.model.eval()
    with torch.no_grad():
        ours = policy.log_probs(batch, with_entropy=False).logp.float() * batch.completion_mask
    tol = 1e-4 if dtype == torch.float32 else 5e-3  # bf16: rounding of one pass
    full = AutoModelForImageTextToText.from_pretrained(ckpt / "model", dtype=dtype).eval()
    assert torch.allclose(hf_logprobs(full, batch) * batch.completion_mask, ours, atol=tol)
    start = AutoModelForImageTextToText.from_pretrained(base, dtype=dtype).eval()
    moved = (hf_logprobs(start, batch) * batch.completion_mask - ours).abs().max()
    assert moved > 10 * tol, f"2 steps moved the log-probs by {moved}: the checks above are void"
    if cfg["model"].get("lora"):  # the adapter on the base replica, as peft users load it
        base_model = AutoModelForImageTextToText.from_pretrained(base, dtype=dtype)
        adapted = PeftModel.from_pretrained(base_model, ckpt / "model" / "adapter").eval()
        assert torch.allclose(hf_logprobs(adapted, batch) * batch.completion_mask, ours, atol=tol)
    else:  # full weights: the tower is the replica's when frozen, trained when trainable
        tower = {n: p for n, p in start.named_parameters() if ".visual." in f".{n}"}
        now = dict(full.named_parameters())
        same = [torch.equal(now[n], p) for n, p in tower.items()]
        assert tower and all(same) == (cfg["model"]["vision_tower"] == "frozen")
    # a new run starts from the saved folder
    again, _ = run_config(case, ckpt / "model", tmp_path / "again", data, monkeypatch,
                          "train.steps=1", "run.name=from-checkpoint")  # fmt: skip
    assert (again / "checkpoints" / "step-00000001" / "model" / "config.json").is_file()
