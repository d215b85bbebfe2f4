"""The weight-update channel: a standalone torch.distributed process group between the trainer's
main process (rank 0) and every vLLM worker of a `grouprl vllm-serve` server (ranks 1..tp).

It is built from its own TCPStore (hosted by the trainer, on `rollout.server.channel_host` /
`channel_port`) and a ProcessGroupGloo (CPU) or ProcessGroupNCCL (GPU) constructed directly, so it
never touches torch.distributed's default group: a trainer under `accelerate launch` keeps its own
global group untouched, and vLLM's tensor-parallel groups are untouched too. Every collective
carries a timeout: a peer that died makes `broadcast` raise instead of waiting forever.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
}


def resolve_backend(backend: str) -> str:
    """auto -> nccl where CUDA is available, else gloo."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight channel backend must be auto, gloo or nccl, got {backend!r}")
    return backend


def host_store(host: str, port: int, timeout_s: float) -> tdist.TCPStore:
    """The channel's TCPStore, served by this process (port 0: a free port; read `store.port`)."""
    return tdist.TCPStore(
        host, port, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join_store(host: str, port: int, timeout_s: float) -> tdist.TCPStore:
    """A client of the channel's TCPStore at host:port."""
    return tdist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def open_group(
    store: Any, tag: str, rank: int, world: int, backend: str, timeout_s: float, host: str
) -> Any:
    """The process group of one channel (`tag` names it inside the store); blocks until all
    `world` ranks have joined or `timeout_s` passed (then raises)."""
    prefixed = tdist.PrefixStore(f"grouprl-weights/{tag}", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = tdist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [tdist.ProcessGroupGloo.create_device(hostname=host)]
        return tdist.ProcessGroupGloo(prefixed, rank, world, opts)
    if backend == "nccl":  # written for GPUs; not run here (no GPU in CI)
        opts = tdist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return tdist.ProcessGroupNCCL(prefixed, rank, world, opts)
    raise ValueError(f"weight channel backend must be gloo or nccl here, got {backend!r}")


def broadcast(group: Any, tensor: torch.Tensor, timeout_s: float) -> None:
    """Broadcast `tensor` from rank 0 of the channel (in place on the other ranks)."""
    opts = tdist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.timeout = timedelta(seconds=timeout_s)
    group.broadcast([tensor], opts).wait()


def channel_device(backend: str) -> torch.device:
    """Where the channel's tensors live: the current CUDA device for nccl, else the CPU."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
