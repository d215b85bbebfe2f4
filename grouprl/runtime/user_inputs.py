"""What a run takes from the user's machine before anything is built: local model paths and the
user's own Python modules (`module:function` rewards, `package.module:Class` models, env specs).

- `check_model_path(model_cfg)`: a `model.name_or_path` that is clearly a local path (it starts
  with /, ./, ../ or ~, or names an existing file or folder, or has more than one '/') and does not
  exist is one error naming the field and the absolute path, for text and image models alike,
  instead of the hub's "Repo id must be ..." that the loaders would report.
- `user_code_on_path()`: the current working directory on `sys.path` while the run resolves and
  runs user code, so that `rewards: [{name: myrewards:score}]` with `myrewards.py` in the working
  directory resolves the same way under `grouprl train` (whose sys.path[0] is the console
  script's folder), `python -m grouprl` and the Python API (`grouprl.train.train(cfg)` from a
  script elsewhere). It is put last, so it never shadows an installed package.
- `split_user_spec(spec, what)` / `import_user_module(module_part, what)`: the one loader of user
  code named "package.module:attr" or "path/to/file.py:attr" (rewards, agent tools, velocity
  modules). A file gets one module name per path (the same in every process, so workers agree);
  a dotted name is looked up in the installed packages, then in the working directory.
- `python_object(what)` / `is_python_object(value)`: how a config names a part the Python API
  was given as an object (a model, a dataset, a reward function, an env factory): the string
  "<python>:what". A run's config.yaml thus records what was used, `grouprl eval` can say that
  the run needs its objects again, and `Trainer` accepts the file back with the same objects.
- `enable_crash_traces()`: faulthandler on, so a crash of the interpreter inside user code (a
  reward calling into C that segfaults) prints every thread's Python stack, naming the function.
"""

from __future__ import annotations

import faulthandler
import hashlib
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

# "package.module:Class" or "file.py:Class": a user module, not a path (model.type flow)
_MODULE_SPEC = re.compile(r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$")


class ModelPathError(FileNotFoundError):
    """model.name_or_path is a local path that does not exist."""


def looks_local(name_or_path: str) -> bool:
    """True when `name_or_path` can only mean a local path (a hub id is "org/name" or "name")."""
    return (
        name_or_path.startswith(("/", "./", "../", "~", ".\\", "..\\"))
        or name_or_path in (".", "..")
        or name_or_path.count("/") > 1
        or Path(name_or_path).expanduser().exists()
    )


def check_model_path(model: Any) -> None:
    """Raise ModelPathError for a local model path that does not exist (see the module docstring)."""
    name = model.name_or_path
    if _MODULE_SPEC.match(name) and not Path(name).exists():
        return  # a user velocity module "pkg.mod:Class" / "file.py:Class": its loader reports
    if looks_local(name) and not Path(name).expanduser().exists():
        raise ModelPathError(
            f"model.name_or_path={name!r}: the local path {str(Path(name).expanduser().resolve())!r} "
            "does not exist (a path starting with /, ./, ../ or ~ is never looked up on the hub; "
            f"working directory: {os.getcwd()!r})"
        )


@contextmanager
def user_code_on_path() -> Iterator[None]:
    """The working directory on sys.path (last) for the duration; removed again if it was added."""
    cwd = os.getcwd()
    present = any(os.path.abspath(p or os.curdir) == cwd for p in sys.path)
    if not present:
        sys.path.append(cwd)
    try:
        yield
    finally:
        if not present and cwd in sys.path:
            sys.path.remove(cwd)


def split_user_spec(spec: Any, what: str) -> tuple[str, str]:
    """("module part", "attr") of a "package.module:attr" / "path/to/file.py:attr" spec;
    `what` ("reward function", "tool") names the spec in errors."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(
            f"{what} {spec!r} must look like 'package.module:function' or "
            "'path/to/file.py:function'"
        )
    module_part, attr = spec.rsplit(":", 1)
    if not module_part or not attr:
        raise ValueError(f"{what} {spec!r}: both the module and the function name are needed")
    return module_part, attr


def import_user_module(module_part: str, what: str) -> ModuleType:
    """Import a dotted module name or a .py file (module docstring); `what` names the spec in
    errors, e.g. "reward function 'my.py:score'"."""
    if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
        path = Path(module_part).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"{what}: file {str(path)!r} does not exist")
        # hash() is salted per process; sha1 of the path gives every process the same name
        name = "grouprl_user_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
        if name in sys.modules:
            return sys.modules[name]
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise ImportError(f"{what}: cannot load {str(path)!r} as Python")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    with user_code_on_path():
        try:
            return importlib.import_module(module_part)
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                f"{what}: cannot import module {module_part!r} from the installed packages or "
                f"the working directory {os.getcwd()!r} ({exc})"
            ) from exc


def enable_crash_traces() -> bool:
    """Turn faulthandler on (stderr, or the process's real stderr when sys.stderr has no file
    descriptor, e.g. captured); returns True if this call turned it on."""
    if faulthandler.is_enabled():
        return False
    for stream in (sys.stderr, sys.__stderr__):
        try:
            faulthandler.enable(file=stream)
            return True
        except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is an OSError
            continue
    return False


PYTHON_OBJECT = "<python>"  # the module part of a config value standing for a Python object


def python_object(what: str) -> str:
    """The config value standing for an object given from Python, e.g. "<python>:reward_len"
    (a reward's key stays the part after the colon, as for "module:function")."""
    return f"{PYTHON_OBJECT}:{what}"


def is_python_object(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(PYTHON_OBJECT + ":")


def python_objects_in(data: Any, prefix: str = "") -> dict[str, str]:
    """{dotted key: value} of every value in a config mapping (lists included, as key[i]) that
    stands for an object given from Python."""
    if isinstance(data, dict):
        items = [(f"{prefix}.{k}" if prefix else str(k), v) for k, v in data.items()]
    elif isinstance(data, list | tuple):
        items = [(f"{prefix}[{i}]", v) for i, v in enumerate(data)]
    else:
        return {prefix: data} if is_python_object(data) else {}
    found: dict[str, str] = {}
    for key, value in items:
        found.update(python_objects_in(value, key))
    return found
