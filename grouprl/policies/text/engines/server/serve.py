"""`grouprl vllm-serve`: build the VLLMEngine (vllm_setup.build_llm, with grouprl's worker
extension for the weight channel) and answer the HTTP API of app.py until interrupted."""

from __future__ import annotations

import argparse
import signal
import sys

WORKER_EXTENSION = "grouprl.policies.text.engines.server.worker.WeightReceiver"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model folder (transformers layout)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: a free one)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM workers (TP ranks)")
    p.add_argument("--dtype", default="float32", help="vLLM's compute dtype for the weights")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of GPU memory vLLM takes")  # fmt: skip
    p.add_argument("--cpu-kvcache-gb", type=int, default=1, help="CPU builds: KV-cache GiB")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences per batch")
    p.add_argument("--prefix-caching", choices=["on", "off"], default="on")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of requests that carry none (trainers send one per completion)")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request waits for the engine or for a weight version")  # fmt: skip
    p.add_argument("--batch-window-ms", type=float, default=10.0,
                   help="a request waits this long for others to generate with (0: only those "
                   "that arrive while the engine is busy)")  # fmt: skip
    p.add_argument("--trust-remote-code", action="store_true")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve(args: argparse.Namespace) -> int:
    from grouprl.policies.text.engines.server.app import VLLMServer
    from grouprl.policies.text.engines.vllm import VLLMEngine
    from grouprl.policies.text.engines.vllm_setup import VLLMSettings, build_llm, eos_ids_for

    if args.tensor_parallel_size < 1:
        raise SystemExit("--tensor-parallel-size must be >= 1")
    settings = VLLMSettings(
        model=args.model, dtype=args.dtype, trust_remote_code=args.trust_remote_code,
        gpu_memory_utilization=args.gpu_memory_utilization, cpu_kvcache_gb=args.cpu_kvcache_gb,
        prefix_caching=args.prefix_caching, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, tensor_parallel_size=args.tensor_parallel_size,
        worker_extension=WORKER_EXTENSION, seed=args.seed,
    )  # fmt: skip
    llm = build_llm(settings)
    engine = VLLMEngine(llm, eos_ids_for(args.model, llm.get_tokenizer(), args.trust_remote_code),
                        seed=args.seed)  # fmt: skip
    info = {"model": args.model, "dtype": args.dtype,
            "tensor_parallel_size": args.tensor_parallel_size}  # fmt: skip
    state = VLLMServer(engine, info, request_timeout_s=args.request_timeout,
                       batch_window_s=args.batch_window_ms / 1000)  # fmt: skip
    http = state.serve(args.host, args.port)
    host, port = http.server_address[:2]
    signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` stops it like Ctrl-C, workers too
    print(f"grouprl vllm-serve: ready at http://{host}:{port}", flush=True)
    try:
        http.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        http.server_close()
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):  # tensor parallel: its worker processes
            core.shutdown()
    print("grouprl vllm-serve: stopped", file=sys.stderr, flush=True)
    return 0
