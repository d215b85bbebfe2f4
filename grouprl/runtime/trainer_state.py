"""The trainer state of a checkpoint on disk without pickle: tensors as safetensors, the rest JSON.

A checkpoint's trainer state (optimizer and scheduler state dicts, step, data position, RNG states,
evaluation results, LoRA adapters ...) is a tree of dicts, lists, tuples, numbers, strings, None,
torch tensors and a few numpy values (numpy's RNG state is a tuple holding a uint32 array). Pickle
can store such a tree, but loading a pickle runs whatever code its author chose: a run directory
received from someone else would execute on resume. So the tree is split in two files that cannot
carry code:

  trainer_state.safetensors   every tensor, under the keys "t0", "t1", ... (safetensors: a JSON
                              header plus raw bytes; loading it only ever makes tensors)
  trainer_state.json          the tree with each tensor replaced by {"__tensor__": "t3"}

The JSON encoding is explicit for everything JSON has no word for, so the tree comes back with the
same Python types (optimizer state dicts are keyed by int, torch's RNG API wants tuples):

  tuple                  {"__tuple__": [items]}
  dict whose keys are not all plain strings (int keys, or a str key starting with "__")
                         {"__dict__": [[key, value], ...]}
  float NaN / inf        {"__float__": "nan" | "inf" | "-inf"}   (the JSON file stays strict)
  numpy array            {"__ndarray__": {"dtype": "uint32", "shape": [...], "data": [...]}}
  numpy scalar           {"__npscalar__": {"dtype": "float64", "value": ...}}  (numeric dtypes only)

Anything else (an arbitrary object, a numpy object array) is refused when SAVING, naming where it
sits in the tree, so a checkpoint that was written can always be read back. Decoding never builds
anything but the types above.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

TENSORS_FILE = "trainer_state.safetensors"
JSON_FILE = "trainer_state.json"
FORMAT = 1
_MARKERS = ("__tensor__", "__tuple__", "__dict__", "__float__", "__ndarray__", "__npscalar__")


class StateEncodingError(TypeError):
    """A value in the trainer state that this format cannot store (raised when saving)."""


class StateFileError(ValueError):
    """trainer_state.json / .safetensors do not decode into a trainer state."""


def _plain_keys(d: dict) -> bool:
    return all(isinstance(k, str) and not k.startswith("__") for k in d)


class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._storages: set[int] = set()

    def tensor(self, t: torch.Tensor) -> dict:
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if ptr is not None and ptr in self._storages:  # safetensors refuses shared storage
            t = t.clone()
        elif ptr is not None:
            self._storages.add(ptr)
        key = f"t{len(self.tensors)}"
        self.tensors[key] = t
        return {"__tensor__": key}

    def encode(self, value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if value is None or type(value) in (bool, int, str):  # exact types: numpy's float64 is a
            return value  # float subclass and must come back as itself
        if type(value) is float:
            return value if math.isfinite(value) else {"__float__": repr(value)}
        if isinstance(value, tuple):
            return {"__tuple__": [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, dict):
            if _plain_keys(value):
                return {k: self.encode(v, f"{where}.{k}") for k, v in value.items()}
            return {"__dict__": [[self.encode(k, f"{where} (a key)"), self.encode(v, f"{where}.{k}")]
                                 for k, v in value.items()]}  # fmt: skip
        return self.numpy(value, where)

    def numpy(self, value: Any, where: str) -> Any:
        try:
            import numpy as np
        except ImportError:  # pragma: no cover - numpy ships with torch
            np = None
        if np is not None and isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
            data = value.tolist()
            return {"__ndarray__": {"dtype": str(value.dtype), "shape": list(value.shape),
                                    "data": self.encode(data, where)}}  # fmt: skip
        if np is not None and isinstance(value, np.generic) and value.dtype.kind in "biuf":
            return {"__npscalar__": {"dtype": str(value.dtype),
                                     "value": self.encode(value.item(), where)}}  # fmt: skip
        raise StateEncodingError(
            f"trainer state {where}: cannot store a {type(value).__module__}."
            f"{type(value).__qualname__} (checkpoints hold tensors, numbers, strings, None, lists, "
            "tuples, dicts and numeric numpy values only; no pickle)"
        )


def encode_state(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """The tree as JSON-ready data plus its tensors {"t0": ...}; raises StateEncodingError."""
    enc = _Encoder()
    return enc.encode(state, "state"), enc.tensors


def decode_state(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of encode_state; raises StateFileError on anything it did not write."""
    if isinstance(tree, list):
        return [decode_state(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        if tree is None or isinstance(tree, bool | int | float | str):
            return tree
        raise StateFileError(f"unexpected JSON value {tree!r}")
    marker = [k for k in tree if k in _MARKERS]
    if not marker:
        return {k: decode_state(v, tensors) for k, v in tree.items()}
    if len(tree) != 1:
        raise StateFileError(f"a {marker[0]} entry must be alone in its object, got {sorted(tree)}")
    kind, body = marker[0], tree[marker[0]]
    if kind == "__tensor__":
        if not isinstance(body, str) or body not in tensors:
            raise StateFileError(f"tensor {body!r} is missing from {TENSORS_FILE}")
        return tensors[body]
    if kind == "__tuple__" and isinstance(body, list):
        return tuple(decode_state(v, tensors) for v in body)
    if (
        kind == "__dict__"
        and isinstance(body, list)
        and all(isinstance(p, list) and len(p) == 2 for p in body)
    ):
        return {decode_state(k, tensors): decode_state(v, tensors) for k, v in body}
    if kind == "__float__" and body in ("nan", "inf", "-inf"):
        return float(body)
    if kind in ("__ndarray__", "__npscalar__") and isinstance(body, dict):
        return _decode_numpy(kind, body, tensors)
    raise StateFileError(f"malformed {kind} entry: {str(body)[:200]}")


def _decode_numpy(kind: str, body: dict, tensors: dict) -> Any:
    import numpy as np

    dtype = np.dtype(str(body.get("dtype")))
    if dtype.kind not in "biuf":  # object / void / string dtypes are never written
        raise StateFileError(f"numpy dtype {dtype} is not allowed in a trainer state")
    if kind == "__npscalar__":
        return dtype.type(decode_state(body.get("value"), tensors))
    data = decode_state(body.get("data"), tensors)
    return np.asarray(data, dtype=dtype).reshape([int(s) for s in body.get("shape", [])])


def write_state(state: dict[str, Any], directory: Path) -> list[Path]:
    """Write `state` as TENSORS_FILE + JSON_FILE into `directory`; returns the two paths."""
    tree, tensors = encode_state(state)
    text = json.dumps({"format": FORMAT, "state": tree}, allow_nan=False)
    tensors_path, json_path = directory / TENSORS_FILE, directory / JSON_FILE
    save_file(tensors, str(tensors_path), metadata={"format": str(FORMAT)})
    json_path.write_text(text, encoding="utf-8")
    return [tensors_path, json_path]


def read_state(directory: Path) -> dict[str, Any]:
    """Read what write_state wrote (no pickle: safetensors and JSON only)."""
    try:
        payload = json.loads((directory / JSON_FILE).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StateFileError(f"{directory / JSON_FILE} is not valid JSON: {exc}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or "state" not in payload:
        raise StateFileError(f"{directory / JSON_FILE} is not a grouprl trainer state (format 1)")
    tensors = load_file(str(directory / TENSORS_FILE), device="cpu")
    state = decode_state(payload["state"], tensors)
    if not isinstance(state, dict):
        raise StateFileError(f"{directory / JSON_FILE} does not hold a mapping")
    return state
