"""hpsv2: an OpenCLIP checkpoint converted without OpenCLIP or pickle, scored as HPSv2 scores.

The checkpoint is a tiny OpenCLIP state dict built here with the key names and layout of the
released HPS_v2*_compressed.pt (fused q/k/v in_proj, [W, D] projections, {"state_dict": ...}); the
converted folder's score is compared with an independent forward of the OpenCLIP architecture
written below with plain torch ops on the ORIGINAL tensors.
"""

from __future__ import annotations

import math
import os
import pickle

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from grouprl.cli import main
from grouprl.envs.rewards import build_reward
from grouprl.replicas import build_replica

V_W, T_W, D, HEADS, LAYERS, PATCH, GRID, CTX = 32, 32, 24, 2, 2, 14, 16, 77


def _openclip_state(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, std=0.05):
        return torch.randn(*shape, generator=g) * std

    sd = {"visual.conv1.weight": r(V_W, 3, PATCH, PATCH), "visual.class_embedding": r(V_W),
          "visual.positional_embedding": r(GRID * GRID + 1, V_W), "visual.proj": r(V_W, D),
          "token_embedding.weight": r(vocab, T_W), "positional_embedding": r(CTX, T_W),
          "text_projection": r(T_W, D), "logit_scale": torch.tensor(math.log(100.0))}  # fmt: skip
    for name, w in (("visual.ln_pre", V_W), ("visual.ln_post", V_W), ("ln_final", T_W)):
        sd[f"{name}.weight"], sd[f"{name}.bias"] = 1 + r(w), r(w)
    for prefix, w in (("visual.transformer.resblocks.", V_W), ("transformer.resblocks.", T_W)):
        for i in range(LAYERS):
            p = f"{prefix}{i}."
            for ln in ("ln_1", "ln_2"):
                sd[p + ln + ".weight"], sd[p + ln + ".bias"] = 1 + r(w), r(w)
            sd[p + "attn.in_proj_weight"], sd[p + "attn.in_proj_bias"] = r(3 * w, w), r(3 * w)
            sd[p + "attn.out_proj.weight"], sd[p + "attn.out_proj.bias"] = r(w, w), r(w)
            sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"] = r(4 * w, w), r(4 * w)
            sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"] = r(w, 4 * w), r(w)
    return sd


def _block(x, sd, p, causal):
    """OpenCLIP's ResidualAttentionBlock: pre-LN, nn.MultiheadAttention, GELU MLP."""
    w = x.shape[-1]
    mha = torch.nn.MultiheadAttention(w, HEADS, batch_first=True)
    mha.load_state_dict({"in_proj_weight": sd[p + "attn.in_proj_weight"],
                         "in_proj_bias": sd[p + "attn.in_proj_bias"],
                         "out_proj.weight": sd[p + "attn.out_proj.weight"],
                         "out_proj.bias": sd[p + "attn.out_proj.bias"]})  # fmt: skip
    n = x.shape[1]
    mask = torch.full((n, n), float("-inf")).triu(1) if causal else None
    h = F.layer_norm(x, (w,), sd[p + "ln_1.weight"], sd[p + "ln_1.bias"], 1e-5)
    x = x + mha(h, h, h, attn_mask=mask, need_weights=False)[0]
    h = F.layer_norm(x, (w,), sd[p + "ln_2.weight"], sd[p + "ln_2.bias"], 1e-5)
    h = F.linear(F.gelu(F.linear(h, sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"])),
                 sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"])  # fmt: skip
    return x + h


@torch.no_grad()
def _openclip_score(sd, pixels, ids):
    """HPSv2's score: diag(normalised image features @ normalised text features.T)."""
    x = F.conv2d(pixels, sd["visual.conv1.weight"], stride=PATCH).flatten(2).transpose(1, 2)
    cls = sd["visual.class_embedding"].expand(len(x), 1, -1)
    x = torch.cat([cls, x], 1) + sd["visual.positional_embedding"]  # [B, 1+g^2, W]
    x = F.layer_norm(x, (V_W,), sd["visual.ln_pre.weight"], sd["visual.ln_pre.bias"], 1e-5)
    for i in range(LAYERS):
        x = _block(x, sd, f"visual.transformer.resblocks.{i}.", causal=False)
    img = F.layer_norm(x[:, 0], (V_W,), sd["visual.ln_post.weight"], sd["visual.ln_post.bias"])
    img = img @ sd["visual.proj"]  # [B, D]
    t = sd["token_embedding.weight"][ids] + sd["positional_embedding"][: ids.shape[1]]
    for i in range(LAYERS):
        t = _block(t, sd, f"transformer.resblocks.{i}.", causal=True)
    t = F.layer_norm(t, (T_W,), sd["ln_final.weight"], sd["ln_final.bias"], 1e-5)
    txt = t[torch.arange(len(ids)), ids.argmax(-1)] @ sd["text_projection"]  # [B, D]
    return (F.normalize(img, dim=-1) * F.normalize(txt, dim=-1)).sum(-1)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("hps")
    processor = build_replica("pickscore", root / "processor")  # CLIP-H's processor, tiny vocab
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(processor))
    sd = _openclip_state(vocab)
    torch.save({"state_dict": sd}, root / "HPS_v2.1_compressed.pt")
    rc = main(["convert", "hpsv2", "--checkpoint", str(root / "HPS_v2.1_compressed.pt"),
               "--out", str(root / "hps"), "--processor", str(processor),
               "--vision-heads", str(HEADS), "--text-heads", str(HEADS)])  # fmt: skip
    assert rc == 0
    return root / "hps", sd, processor


def test_converted_scores_equal_the_openclip_forward(converted):
    from transformers import AutoImageProcessor, AutoTokenizer

    folder, sd, _ = converted
    g = torch.Generator().manual_seed(1)
    images = torch.rand(3, 3, 240, 260, generator=g)  # [N, 3, H, W] in [0, 1]
    prompts = ["a red bicycle", "a cat", "a red bicycle"]
    reward = build_reward("hpsv2", model=str(folder), preprocess="processor", batch_size=2)
    got = torch.tensor(reward(images=images, prompts=prompts))
    ip = AutoImageProcessor.from_pretrained(folder)
    pil = [Image.fromarray((im * 255).round().byte().permute(1, 2, 0).numpy()) for im in images]
    pixels = ip(images=pil, return_tensors="pt")["pixel_values"]  # [N, 3, 224, 224]
    tok = AutoTokenizer.from_pretrained(folder)
    ids = [tok(p).input_ids for p in prompts]
    ids = torch.tensor([i + [0] * (CTX - len(i)) for i in ids])  # OpenCLIP pads with 0 to 77
    want = _openclip_score(sd, pixels, ids)
    assert torch.allclose(got, want, atol=1e-5), (got, want)
    assert got[0] != got[1]
    tensor_path = build_reward("hpsv2", model=str(folder))(images=images, prompts=prompts)
    assert torch.allclose(torch.tensor(tensor_path), want, atol=2e-2)  # torch resize, no PIL


def test_a_pickle_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "HPS_v2_compressed.pt"
    evil.write_bytes(pickle.dumps({"state_dict": Payload()}))
    with pytest.raises(ValueError, match="weights_only refused"):
        from grouprl.envs.rewards.openclip_convert import read_checkpoint

        read_checkpoint(evil)
    assert main(["convert", "hpsv2", "--checkpoint", str(evil), "--out", str(tmp_path / "o")]) == 2
    assert not marker.exists()
    assert main(["convert", "hpsv2", "--checkpoint", str(tmp_path / "nope.pt"),
                 "--out", str(tmp_path / "o")]) == 2  # fmt: skip
