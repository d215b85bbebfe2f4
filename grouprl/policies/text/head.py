"""The model's own output head: hidden states -> logits exactly as its forward computes them.

grouprl scores and samples by running a model's decoder itself (prompt caches shared by a
group, padding dropped before the LM head) and then the head on the states it keeps. A family's
forward often does more after its decoder than the bare LM head: Gemma 2 / 3 soft-cap the final
logits (c * tanh(z / c), `final_logit_softcapping`), Cohere multiplies them by `logit_scale`,
Granite divides them by `logits_scaling`, and a family added tomorrow may do something else.
Nothing here lists those fields or families: the function is taken from the model itself.

`output_head(model, body)` returns an `OutputHead`, hidden [..., H] -> logits [..., V], that runs
the model's OWN forward with `body` (the module whose output states grouprl computed: the
decoder for a causal LM, the inner model for a VLM) temporarily replaced by a stand-in that
returns the given states. The LM head and all post-processing therefore come from the family's
code. A probe then tells whether that function is exactly the plain nn.Linear head on states of
very different scales (logits from ~0.01 to ~1e4, where soft-capping or any scale shows): if so,
`OutputHead.linear` is that Linear and the fused head (fused_head.py) may run it; if not, callers
use the function through the chunked, checkpointed autograd head (logprobs.py).

What cannot be derived (the body is not a module of the model, or the forward does not run with
the stand-in, or returns logits of another length) raises `HeadUnavailable` naming the class and
the reason; the policies' load-time probe (scoring_probe.py) then falls back to scoring with the
model's full forward.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from transformers.modeling_outputs import BaseModelOutputWithPast

# hidden-state scales of the linear probe's rows: the logits' largest magnitude on each row
PROBE_LOGIT_SCALES = (1e-2, 1.0, 1e2, 1e4)


class HeadUnavailable(RuntimeError):
    """The model's head function cannot be derived; the message names the class and why."""


class _Given(BaseModelOutputWithPast):
    """The stand-in body's output: the given states; any other field a forward reads is None
    (router logits of an MoE forward: its auxiliary loss is then 0 and not part of the logits)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _StandIn(torch.nn.Module):
    """Returns the states it was given, whatever the forward passes it."""

    def __init__(self, hidden: Tensor) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, *args: Any, **kwargs: Any) -> _Given:
        return _Given(last_hidden_state=self.hidden)


class OutputHead:
    """hidden [..., H] -> logits [..., V] as the model's forward computes them after its body.

    linear: the model's nn.Linear head when the function is exactly that Linear (the fused head
    may run it), else None. kind: "linear" or "model" (the forward's own post-processing).
    `parameters()` gives the weights the function uses outside the body (for checkpointing)."""

    def __init__(self, model: Any, parent: torch.nn.Module, name: str) -> None:
        self._model = weakref.ref(model)
        self._parent, self._name = weakref.ref(parent), name
        self.model_class = type(model).__name__
        self.linear: torch.nn.Linear | None = None

    @property
    def kind(self) -> str:
        return "linear" if self.linear is not None else "model"

    def describe(self) -> str:
        if self.linear is not None:
            return f"{self.model_class}: the plain linear LM head (fused head)"
        return (
            f"{self.model_class}: the model's own head function (its forward after the decoder: "
            "post-processing such as soft-capping or logit scaling; chunked autograd head)"
        )

    def __call__(self, hidden: Tensor) -> Tensor:
        if self.linear is not None:
            return self.linear(hidden)  # [..., V]: bitwise what the forward computes (probed)
        return self.through_forward(hidden)

    def through_forward(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> logits [..., V] from the model's forward with the body stood in."""
        model, parent = self._model(), self._parent()
        if model is None or parent is None:
            raise HeadUnavailable("the model of this OutputHead no longer exists")
        lead = hidden.shape[:-1]
        x = hidden if hidden.dim() == 3 else hidden.reshape(1, -1, hidden.shape[-1])  # [B, L, H]
        body = parent._modules[self._name]
        parent._modules[self._name] = _StandIn(x)
        try:
            out = model(
                input_ids=torch.zeros(x.shape[:2], dtype=torch.long, device=x.device),
                use_cache=False,
            )
        finally:
            parent._modules[self._name] = body
        logits = getattr(out, "logits", None)
        if logits is None or logits.shape[:2] != x.shape[:2]:
            got = None if logits is None else tuple(logits.shape)
            raise HeadUnavailable(
                f"{self.model_class}'s forward with given states of shape {tuple(x.shape)} "
                f"returned logits {got}, not one row per state"
            )
        return logits.reshape(*lead, logits.shape[-1])  # [..., V]

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The model's parameters outside the body, plus the output embeddings' (tied heads)."""
        model, parent = self._model(), self._parent()
        if model is None or parent is None:
            return iter(())
        inside = {id(p) for p in parent._modules[self._name].parameters()}
        out = [p for p in model.parameters() if id(p) not in inside]
        emb = model.get_output_embeddings()
        if emb is not None:
            seen = {id(p) for p in out}
            out += [p for p in emb.parameters() if id(p) not in seen]
        return iter(out)


def decoder_of(model: Any) -> Any:
    """The module whose output states grouprl computes (the decoder): transformers'
    `get_decoder()`, except where that returns the model itself (a causal LM whose
    `base_model_prefix` names no attribute of it, as Llama 4's and Mllama's text models); then
    the model's child that holds its input embeddings (the body its forward runs)."""
    body = model.get_decoder()
    if body is not model:
        return body
    emb = model.get_input_embeddings()
    for child in model.children():
        if any(m is emb for m in child.modules()):
            return child
    return body


# model -> (signature, OutputHead): derived once per model object and head module
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def output_head(model: Any, body: Any = None) -> OutputHead:
    """The head function of `model` (a transformers model, peft unwrapped) after `body` (None:
    `decoder_of(model)`). Cached per model; derived again when the body or the output
    embeddings module changed (e.g. a LoRA layer wrapped the LM head)."""
    body = decoder_of(model) if body is None else body
    emb = model.get_output_embeddings()
    signature = (id(body), id(emb), type(emb))
    cached = _CACHE.get(model)
    if cached is not None and cached[0] == signature:
        return cached[1]
    head = _derive(model, body, emb)
    _CACHE[model] = (signature, head)
    return head


def _derive(model: Any, body: Any, emb: Any) -> OutputHead:
    """The head after `body`; where the forward does not run with the body itself stood in (an
    image-text-to-text model whose inner model asks its language model for the input embeddings:
    Gemma 3, GOT-OCR2, Fuyu), the enclosing modules up to the model's child are tried in turn;
    the forward reads only their output states, which are the body's."""
    chain = _enclosing(model, body)
    if not chain:
        raise HeadUnavailable(
            f"{type(model).__name__}: its decoder ({type(body).__name__}) is not a submodule of "
            "the model, so its forward cannot be run on given states"
        )
    first: Exception | None = None
    for where in chain:
        try:
            return _derive_at(model, where, emb)
        except Exception as e:
            first = first or e
    assert first is not None
    if isinstance(first, HeadUnavailable):
        raise first
    text = str(first).strip()
    raise HeadUnavailable(
        f"{type(model).__name__}'s forward does not run on given decoder states "
        f"({type(first).__name__}: {text.splitlines()[0] if text else ''})"
    ) from first


def _derive_at(model: Any, where: tuple[torch.nn.Module, str], emb: Any) -> OutputHead:
    head = OutputHead(model, *where)
    hidden_size = _hidden_size(model, emb)
    param = next(model.parameters())
    dtype = emb.weight.dtype if isinstance(emb, torch.nn.Linear) else param.dtype
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(1, len(PROBE_LOGIT_SCALES), hidden_size, generator=gen)  # [1, 4, H]
    probe = probe.to(device=param.device, dtype=dtype)
    with torch.no_grad():
        via_forward = head.through_forward(probe)  # [1, 4, V]
        if type(emb) is torch.nn.Linear and via_forward.shape[-1] == emb.out_features:
            # rows rescaled so their largest bare logit is each of PROBE_LOGIT_SCALES
            bare = emb(probe).float().abs().amax(-1, keepdim=True).clamp(min=1e-30)  # [1, 4, 1]
            scales = torch.tensor(PROBE_LOGIT_SCALES, device=param.device)[None, :, None]
            probe = (probe.float() * scales / bare).to(dtype)  # [1, 4, H]
            if torch.equal(head.through_forward(probe).float(), emb(probe).float()):
                head.linear = emb
    return head


def _enclosing(model: Any, body: Any) -> list[tuple[torch.nn.Module, str]]:
    """(parent, attribute name) of `body` and of each module enclosing it up to the model's own
    child, innermost first; [] when `body` is not a submodule of `model`."""
    path = next((n for n, m in model.named_modules() if m is body and n), None)
    if path is None:
        return []
    parts = path.split(".")
    out = []
    for depth in range(len(parts), 0, -1):
        parent = model.get_submodule(".".join(parts[: depth - 1]))
        out.append((parent, parts[depth - 1]))
    return out


def _hidden_size(model: Any, emb: Any) -> int:
    if isinstance(emb, torch.nn.Linear):
        return emb.in_features
    weight = getattr(emb, "weight", None)
    if isinstance(weight, Tensor) and weight.dim() == 2:
        return weight.shape[1]
    return model.config.get_text_config().hidden_size
