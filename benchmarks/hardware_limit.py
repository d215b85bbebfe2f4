"""How close a grouprl GRPO step comes to this CPU's matmul rate (utilisation), measured in one run.

FLOPs of a step (the issue's model; attention score/value products, norms and the softmax are
left out, so utilisation is slightly understated):
    generation  2 x params x generated tokens      (+ each group's prompt prefilled once)
    update      6 x params x trained tokens        (completion tokens + each group's prompt once:
                                                    the exact gradient needs the prompt's K/V)
    extra       2 x params x tokens of extra forward passes (old log-probs when mu > 1, the
                                                    reference model when beta > 0: none here)
where params = the parameters that take part in matmuls (decoder + LM head; an input embedding
that is not tied to the head is a lookup and does not count).
The peak is the best float32 matmul rate of torch.mm on this CPU, measured in the same process
with the same threads, right before and right after the steps (the larger is kept), on the
workload's own shapes (tokens x hidden x intermediate / vocabulary) and a square 1024^3.

The step is grouprl's default path on the text_vs_trl workload (8 prompts x 8 samples, 32-token
completions, mu = 1, beta = 0), run in-process with the same code as benchmarks/text_vs_trl.py.

Matmul floor: one more step runs under a dispatch-mode recorder; its matrix products (aten mm /
addmm / bmm) are sorted into generation (inside the engine's generate), the update's forward and
the update's backward (under autograd's engine). They are then replayed back to back on random
float32 tensors of the same shapes and strides (one per operand address, so each weight matrix
is one tensor, as in the step), with nothing else in between: the time these products take on
this CPU by themselves. A step that does them cannot be faster, and a step that skipped its
update forward could at best save that phase's share. `--steps` more steps follow, each followed
by one replay; the shares are medians of replay / the step just before it. When
`--out`/text_vs_trl.json holds the model's grouprl/TRL time ratio, the floor is set against issue
6's goal, a step of half TRL's time, both as shares of this run's step.

    .venv/bin/python benchmarks/hardware_limit.py [--models small,large --steps 3 --threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import text_vs_trl  # noqa: E402


def matmul_peak(hidden: int, intermediate: int, vocab: int, repeats: int = 5) -> dict[str, float]:
    """Best GFLOP/s of torch.mm (float32) over a few representative shapes."""
    import torch

    shapes = [(2048, hidden, intermediate), (2048, intermediate, hidden), (1024, 1024, 1024)]
    if vocab > 1024:
        shapes.append((512, hidden, vocab))
    best: dict[str, float] = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)  # warm-up
        rate = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            rate = max(rate, 2 * m * k * n / (time.perf_counter() - t0) / 1e9)
        best[f"{m}x{k}x{n}"] = rate
    return best


def matmul_params(model_dir: Path) -> dict[str, int]:
    """Decoder and LM-head parameter counts of the saved model (see the module docstring)."""
    import json

    from safetensors import safe_open

    cfg = json.loads((model_dir / "config.json").read_text())
    total = head = embed = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                n = st.get_slice(k).get_shape()
                size = 1
                for d in n:
                    size *= d
                total += size
                if "embed_tokens" in k:
                    embed = size
                if k.startswith("lm_head"):
                    head = size
    tied = cfg.get("tie_word_embeddings", False) or head == 0
    head = embed if tied else head
    body = total - embed - (0 if tied else head)
    return {"body": body, "head": head, "matmul": body + head, "total": total}


MATMUL_OPS = ("mm", "addmm", "bmm")
PHASES = ("generate", "update_forward", "update_backward")
# One recorded operand: shape, strides, and the address of its data in the step (so that a weight
# used by every decode step is one tensor in the replay, as it is one matrix in the step).
Operand = tuple[tuple[int, ...], tuple[int, ...], int]
Call = tuple[str, list[Operand]]


class _MatmulRecorder(TorchDispatchMode):
    """Records every mm / addmm / bmm with its operands, by phase."""

    def __init__(self) -> None:
        super().__init__()
        self.generating = False
        self.calls: dict[str, list[Call]] = {k: [] for k in PHASES}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        import torch

        out = func(*args, **(kwargs or {}))
        op = func.overloadpacket.__name__
        if op in MATMUL_OPS:
            if self.generating:
                phase = "generate"
            elif torch._C._current_autograd_node() is not None:  # inside autograd's backward
                phase = "update_backward"
            else:
                phase = "update_forward"
            operands = [(tuple(t.shape), tuple(t.stride()), t.data_ptr())
                        for t in args if isinstance(t, torch.Tensor)]  # fmt: skip
            self.calls[phase].append((op, operands))
        return out


def record_matmuls(step: Any, engine: Any) -> dict[str, list[Call]]:
    """Run `step()` once, recording its matrix products; those inside engine.generate count as
    generation, those under autograd's engine as the update's backward, the rest as its forward."""
    recorder = _MatmulRecorder()
    inner = engine.generate

    def generate(*args: Any, **kw: Any) -> Any:
        recorder.generating = True
        try:
            return inner(*args, **kw)
        finally:
            recorder.generating = False

    engine.generate = generate
    try:
        with recorder:
            step()
    finally:
        engine.generate = inner
    return recorder.calls


def replay_work(calls: list[Call]) -> list[tuple[Any, list[Any]]]:
    """The calls as (function, operands) on random float32 tensors with the recorded shapes and
    strides: one tensor per recorded operand address and shape, so weights are reused across
    calls as in the step (and are in cache or not alike)."""
    import torch

    fns = {"mm": torch.mm, "addmm": torch.addmm, "bmm": torch.bmm}
    pool: dict[Operand, Any] = {}

    def tensor(operand: Operand) -> Any:
        if operand not in pool:
            shape, stride, _ = operand
            t = torch.empty_strided(shape, stride)
            t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,)).normal_()
            pool[operand] = t  # (stride-0 operands, e.g. the gradient of a sum, share elements)
        return pool[operand]

    return [(fns[op], [tensor(o) for o in operands]) for op, operands in calls]


def replay_seconds(work: list[tuple[Any, list[Any]]]) -> float:
    """Wall time of one back-to-back pass over the calls."""
    t0 = time.perf_counter()
    for fn, args in work:
        fn(*args)
    return time.perf_counter() - t0


def matmul_gflop(calls: list[Call]) -> float:
    total = 0.0
    for op, operands in calls:
        a, b = (
            (operands[1][0], operands[2][0]) if op == "addmm" else (operands[0][0], operands[1][0])
        )
        batch = a[0] if op == "bmm" else 1
        total += 2.0 * batch * a[-2] * a[-1] * b[-1]
    return total / 1e9


def matmul_floor(step: Any, engine: Any, pairs: int) -> dict[str, Any]:
    """Record one step's products, then `pairs` times: one step, then one replay of its products.
    Each replay is set against the step run just before it, so that the shares compare the two
    under the same machine speed (on this shared CPU it drifts by +-20% within minutes)."""
    calls = record_matmuls(step, engine)
    work = {k: replay_work(v) for k, v in calls.items()}
    for w in work.values():
        replay_seconds(w)  # warm-up
    rows = []
    for _ in range(pairs):
        t0 = time.perf_counter()
        step()
        step_s = time.perf_counter() - t0
        rows.append({"step_s": step_s, "seconds": {k: replay_seconds(w) for k, w in work.items()}})
    total = [sum(r["seconds"].values()) for r in rows]
    no_fwd = [r["seconds"]["generate"] + r["seconds"]["update_backward"] for r in rows]
    return {
        "seconds": {k: C.median([r["seconds"][k] for r in rows]) for k in PHASES},
        "total_s": C.median(total),
        "step_s": C.median([r["step_s"] for r in rows]),
        "share_of_step": C.median([t / r["step_s"] for t, r in zip(total, rows)]),
        "share_without_update_forward": C.median([t / r["step_s"] for t, r in zip(no_fwd, rows)]),
        "gflop": {k: matmul_gflop(v) for k, v in calls.items()},
        "calls": {k: len(v) for k, v in calls.items()},
        "pairs": rows,
    }


def trl_time_ratio(out: Path, model: str) -> float | None:
    """grouprl/TRL time per step for `model` from a text_vs_trl.json in `out`, if there is one."""
    import json

    path = out / "text_vs_trl.json"
    if not path.exists():
        return None
    return json.loads(path.read_text()).get(model, {}).get("summary", {}).get("time_ratio")


def step_flops(p: dict[str, int], tokens: dict[str, int]) -> dict[str, float]:
    gen_tokens = tokens["generated"] + tokens["prompt_once_per_group"]
    trained = tokens["generated"] + tokens["prompt_once_per_group"]
    return {
        "generate": 2.0 * p["matmul"] * gen_tokens,
        "update": 6.0 * p["matmul"] * trained,
        "extra": 0.0,  # mu = 1 (old log-probs from the same weights), beta = 0 (no reference)
    }


def run_model(name: str, a: argparse.Namespace) -> dict[str, Any]:
    spec = C.MODELS[name]
    model_dir = C.build_model_dir(a.out / "models" / name, name, seed=a.seed)
    vocab = spec["vocab"] or 259
    before = matmul_peak(spec["hidden"], spec["intermediate"], vocab)
    ns = argparse.Namespace(model_dir=model_dir, engine=a.engine, seed=a.seed, lr=1e-5,
                            warmup=a.warmup, steps=a.steps,
                            after_steps=lambda step, engine: matmul_floor(step, engine, a.steps))  # fmt: skip
    run = text_vs_trl.run_grouprl(ns)
    floor = run["after_steps"]
    after = matmul_peak(spec["hidden"], spec["intermediate"], vocab)
    peak = max(max(before.values()), max(after.values()))
    params = matmul_params(model_dir)
    steps = run["steps"][a.warmup :]
    tokens = run["tokens"][a.warmup :]
    phases: dict[str, list[float]] = {"generate": [], "update": [], "step": []}
    for s, t in zip(steps, tokens):
        f = step_flops(params, t)
        phases["generate"].append(f["generate"] / s["generate_s"] / 1e9)
        phases["update"].append((f["update"] + f["extra"]) / s["update_s"] / 1e9)
        phases["step"].append(sum(f.values()) / s["total_s"] / 1e9)
    achieved = {k: C.median(v) for k, v in phases.items()}
    return {
        "params": params,
        "matmul_peak_gflops": peak,
        "matmul_rates_before": before,
        "matmul_rates_after": after,
        "achieved_gflops": achieved,
        "utilisation": {k: v / peak for k, v in achieved.items()},
        "s_per_step": C.median([s["total_s"] for s in steps]),
        "matmul_floor": floor,
        "trl_time_ratio": trl_time_ratio(a.out, name),
        "flops_per_step": C.median([sum(step_flops(params, t).values()) for t in tokens]),
        "tokens": tokens,
        "steps": steps,
        "engine": run["engine"],
    }


def floor_table(results: dict[str, Any], models: list[str]) -> tuple[list[str], list[list[str]]]:
    """The floor as a share of the step, and the share issue 6's goal allows: a step of half
    TRL's time is 0.5 / (grouprl/TRL time ratio) of grouprl's step (the ratio measured alternated
    by text_vs_trl.py, so machine drift between the two runs cancels)."""
    header = ["model", "step s", "matmul floor s (generate / update fwd / update bwd)",
              "floor / step", "floor without update fwd / step",
              "0.5 x TRL / step"]  # fmt: skip
    rows = []
    for name in models:
        r = results[name]
        f, ratio = r["matmul_floor"], r["trl_time_ratio"]
        parts = " / ".join(f"{f['seconds'][k]:.3f}" for k in PHASES)
        rows.append([name, f"{f['step_s']:.3f}", f"{f['total_s']:.3f} ({parts})",
                     f"{100 * f['share_of_step']:.0f}%",
                     f"{100 * f['share_without_update_forward']:.0f}%",
                     "-" if ratio is None else f"{100 * 0.5 / ratio:.0f}%"])  # fmt: skip
    return header, rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="small,large")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", default="", help="grouprl rollout.engine (default: config default)")
    p.add_argument("--out", type=Path, default=C.RESULTS)
    a = p.parse_args(argv)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    if not models or set(models) - set(C.MODELS):
        raise SystemExit(f"--models: choose from {list(C.MODELS)}")
    C.worker_setup(a.threads)
    info = C.machine_info(a.threads)
    print(f"machine: {C.describe_machine(info)}")
    results: dict[str, Any] = {"machine": info, "settings": vars(a) | {"out": str(a.out)}}
    for name in models:
        t0 = time.perf_counter()
        results[name] = run_model(name, a)
        print(f"  [{name}] {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for name in models:
        r = results[name]
        rows.append([name, f"{r['params']['matmul'] / 1e6:.2f}M", f"{r['flops_per_step'] / 1e9:.1f}",
                     f"{r['s_per_step']:.2f}", f"{r['matmul_peak_gflops']:.1f}"]
                    + [f"{r['achieved_gflops'][k]:.1f} ({100 * r['utilisation'][k]:.0f}%)"
                       for k in ("generate", "update", "step")])  # fmt: skip
    header = ["model", "matmul params", "GFLOP/step", "s/step", "peak GFLOP/s",
              "generate GFLOP/s (util)", "update GFLOP/s (util)", "step GFLOP/s (util)"]  # fmt: skip
    print()
    print(f"grouprl engine {results[models[0]]['engine']!r}")
    print(C.format_table(header, rows))
    print()
    print(C.format_table(*floor_table(results, models)))
    warn = C.warn_if_loaded(info, alternated=False)
    if warn:
        print(warn)
    C.write_json(a.out / "hardware_limit.json", results)
    panels = [("GFLOP/s",
               {"matmul peak": [results[m]["matmul_peak_gflops"] for m in models],
                **{k: [results[m]["achieved_gflops"][k] for m in models]
                   for k in ("generate", "update", "step")}}, models)]  # fmt: skip
    C.bar_png(a.out / "hardware_limit.png", panels, "grouprl GRPO step vs this CPU's matmul rate")
    print(f"wrote {a.out / 'hardware_limit.json'} and {a.out / 'hardware_limit.png'}")
    for m in models:
        print(
            f"[{m}] utilisation of the matmul peak: {100 * results[m]['utilisation']['step']:.0f}%"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
