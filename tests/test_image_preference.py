"""hpsv2: an OpenCLIP checkpoint converted without OpenCLIP or pickle, scored as HPSv2 scores.

The checkpoint is a tiny OpenCLIP state dict built here with the key names and layout of the
released HPS_v2*_compressed.pt (fused q/k/v in_proj, [W, D] projections, {"state_dict": ...}); the
converted folder's score is compared with an independent forward of the OpenCLIP architecture
written below with plain torch ops on the ORIGINAL tensors.
"""

from __future__ import annotations

import json
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
        from grouprl.envs.rewards.released import read_checkpoint

        read_checkpoint(evil)
    assert main(["convert", "hpsv2", "--checkpoint", str(evil), "--out", str(tmp_path / "o")]) == 2
    assert not marker.exists()
    assert main(["convert", "hpsv2", "--checkpoint", str(tmp_path / "nope.pt"),
                 "--out", str(tmp_path / "o")]) == 2  # fmt: skip


# ---- image_reward: ImageReward's BLIP layout, converted, against its own forward ----------------

IR_V, IR_T, IR_HEADS, IR_PATCH, IR_GRID = 32, 32, 2, 16, 14
WORDS = ["a", "red", "bicycle", "cat", "on", "the", "wall", "##s", "blue"]


def _bert_tokenizer(folder):
    """BLIP's tokenizer: BERT uncased plus its added [DEC] (bos) and [ENC] tokens."""
    from transformers import BertTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")  # fmt: skip
    tok = BertTokenizer(str(folder / "vocab.txt"), do_lower_case=True)
    tok.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
    tok.save_pretrained(folder)
    return len(tok)


def _image_reward_state(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, std=0.05):
        return torch.randn(*shape, generator=g) * std

    v, t = "blip.visual_encoder.", "blip.text_encoder."
    sd = {f"{v}patch_embed.proj.weight": r(IR_V, 3, IR_PATCH, IR_PATCH),
          f"{v}patch_embed.proj.bias": r(IR_V), f"{v}cls_token": r(1, 1, IR_V),
          f"{v}pos_embed": r(1, IR_GRID**2 + 1, IR_V), f"{v}norm.weight": 1 + r(IR_V),
          f"{v}norm.bias": r(IR_V), f"{t}embeddings.word_embeddings.weight": r(vocab, IR_T),
          f"{t}embeddings.position_embeddings.weight": r(40, IR_T),
          f"{t}embeddings.LayerNorm.weight": 1 + r(IR_T), f"{t}embeddings.LayerNorm.bias": r(IR_T),
          f"{t}embeddings.position_ids": torch.arange(40)[None],
          "blip.vision_proj.weight": r(8, IR_V), "blip.vision_proj.bias": r(8)}  # fmt: skip
    for i in range(2):
        p = f"{v}blocks.{i}."
        for name in ("norm1", "norm2"):
            sd[f"{p}{name}.weight"], sd[f"{p}{name}.bias"] = 1 + r(IR_V), r(IR_V)
        for name, o, n in (("attn.qkv", 3 * IR_V, IR_V), ("attn.proj", IR_V, IR_V),
                           ("mlp.fc1", 4 * IR_V, IR_V), ("mlp.fc2", IR_V, 4 * IR_V)):  # fmt: skip
            sd[f"{p}{name}.weight"], sd[f"{p}{name}.bias"] = r(o, n), r(o)
        p = f"{t}encoder.layer.{i}."
        for att, kv_in in (("attention", IR_T), ("crossattention", IR_V)):
            sd[f"{p}{att}.self.query.weight"], sd[f"{p}{att}.self.query.bias"] = (
                r(IR_T, IR_T),
                r(IR_T),
            )
            for kv in ("key", "value"):
                sd[f"{p}{att}.self.{kv}.weight"], sd[f"{p}{att}.self.{kv}.bias"] = (
                    r(IR_T, kv_in),
                    r(IR_T),
                )
            sd[f"{p}{att}.output.dense.weight"], sd[f"{p}{att}.output.dense.bias"] = (
                r(IR_T, IR_T),
                r(IR_T),
            )
            sd[f"{p}{att}.output.LayerNorm.weight"] = 1 + r(IR_T)
            sd[f"{p}{att}.output.LayerNorm.bias"] = r(IR_T)
        sd[f"{p}intermediate.dense.weight"], sd[f"{p}intermediate.dense.bias"] = r(64, IR_T), r(64)
        sd[f"{p}output.dense.weight"], sd[f"{p}output.dense.bias"] = r(IR_T, 64), r(IR_T)
        sd[f"{p}output.LayerNorm.weight"], sd[f"{p}output.LayerNorm.bias"] = 1 + r(IR_T), r(IR_T)
    dims = [IR_T, 16, 8, 4, 2, 1]
    for j, i in enumerate((0, 2, 4, 6, 7)):
        sd[f"mlp.layers.{i}.weight"] = r(dims[j + 1], dims[j], std=0.5)
        sd[f"mlp.layers.{i}.bias"] = r(dims[j + 1], std=0.5)
    return sd


def _attend(q, k, v, heads, key_mask=None):
    b, n, w = q.shape
    split = lambda x: x.reshape(b, x.shape[1], heads, w // heads).transpose(1, 2)  # noqa: E731
    scores = split(q) @ split(k).transpose(-1, -2) / math.sqrt(w // heads)  # [b, h, n, m]
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return (scores.softmax(-1) @ split(v)).transpose(1, 2).reshape(b, n, w)


@torch.no_grad()
def _image_reward_by_hand(sd, pixels, ids, mask):
    """BLIP's ViT (timm layout) and BERT text encoder with cross-attention, ImageReward's head."""
    v, t = "blip.visual_encoder.", "blip.text_encoder."
    lin = lambda x, p: F.linear(x, sd[p + ".weight"], sd[p + ".bias"])  # noqa: E731
    ln = lambda x, p, eps: F.layer_norm(x, x.shape[-1:], sd[p + ".weight"], sd[p + ".bias"], eps)  # noqa: E731
    x = F.conv2d(pixels, sd[f"{v}patch_embed.proj.weight"], sd[f"{v}patch_embed.proj.bias"],
                 stride=IR_PATCH).flatten(2).transpose(1, 2)  # fmt: skip
    x = torch.cat([sd[f"{v}cls_token"].expand(len(x), 1, -1), x], 1) + sd[f"{v}pos_embed"]
    for i in range(2):
        p = f"{v}blocks.{i}."
        h = ln(x, p + "norm1", 1e-6)
        q, k, val = lin(h, p + "attn.qkv").chunk(3, -1)
        x = x + lin(_attend(q, k, val, IR_HEADS), p + "attn.proj")
        x = x + lin(F.gelu(lin(ln(x, p + "norm2", 1e-6), p + "mlp.fc1")), p + "mlp.fc2")
    img = ln(x, f"{v}norm", 1e-6)  # [B, 1+P, W]
    h = sd[f"{t}embeddings.word_embeddings.weight"][ids] + sd[
        f"{t}embeddings.position_embeddings.weight"][: ids.shape[1]]  # fmt: skip
    h = ln(h, f"{t}embeddings.LayerNorm", 1e-12)
    for i in range(2):
        p = f"{t}encoder.layer.{i}."
        a = _attend(lin(h, p + "attention.self.query"), lin(h, p + "attention.self.key"),
                    lin(h, p + "attention.self.value"), IR_HEADS, mask)  # fmt: skip
        h = ln(lin(a, p + "attention.output.dense") + h, p + "attention.output.LayerNorm", 1e-12)
        c = _attend(lin(h, p + "crossattention.self.query"), lin(img, p + "crossattention.self.key"),
                    lin(img, p + "crossattention.self.value"), IR_HEADS)  # fmt: skip
        h = ln(lin(c, p + "crossattention.output.dense") + h,
               p + "crossattention.output.LayerNorm", 1e-12)  # fmt: skip
        m = lin(F.gelu(lin(h, p + "intermediate.dense")), p + "output.dense")
        h = ln(m + h, p + "output.LayerNorm", 1e-12)
    r = h[:, 0]
    for i in (0, 2, 4, 6, 7):
        r = lin(r, f"mlp.layers.{i}")
    return (r[:, 0] - 0.16717362830052426) / 1.0333394966054072


def test_image_reward_converted_equals_blip_by_hand(tmp_path):
    from transformers import AutoImageProcessor, AutoTokenizer

    vocab = _bert_tokenizer(tmp_path / "bert")
    sd = _image_reward_state(vocab)
    torch.save(sd, tmp_path / "ImageReward.pt")
    assert main(["convert", "image_reward", "--checkpoint", str(tmp_path / "ImageReward.pt"),
                 "--out", str(tmp_path / "ir"), "--tokenizer", str(tmp_path / "bert"),
                 "--vision-heads", "2", "--text-heads", "2"]) == 0  # fmt: skip
    g = torch.Generator().manual_seed(2)
    images = torch.rand(3, 3, 230, 250, generator=g)  # [N, 3, H, W] in [0, 1]
    prompts = ["a red bicycle", "a cat on the wall", "blue walls"]
    got = torch.tensor(build_reward("image_reward", model=str(tmp_path / "ir"), batch_size=2)(
        images=images, prompts=prompts))  # fmt: skip
    ip = AutoImageProcessor.from_pretrained(tmp_path / "ir")
    pil = [Image.fromarray((im * 255).round().byte().permute(1, 2, 0).numpy()) for im in images]
    pixels = ip(images=pil, return_tensors="pt")["pixel_values"]  # [N, 3, 224, 224]
    enc = AutoTokenizer.from_pretrained(tmp_path / "ir")(
        prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt"
    )
    want = _image_reward_by_hand(sd, pixels, enc.input_ids, enc.attention_mask.bool())
    assert torch.allclose(got, want, atol=1e-4), (got, want)
    assert len(set(got.tolist())) == 3
    ignored = json.loads((tmp_path / "ir" / "image_reward.json").read_text())["ignored_keys"]
    assert ignored == ["blip.vision_proj.bias", "blip.vision_proj.weight"]
