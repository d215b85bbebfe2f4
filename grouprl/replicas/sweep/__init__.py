"""The architecture sweep: `python -m grouprl.replicas sweep [--only NAME...] [--jobs N] [--out DIR]
[--limit-s S] [--vllm]`.

Every causal-LM and image-text-to-text architecture the installed transformers registers gets a
tiny random model derived from its config class (tiny.py) and grouprl's checks (checks.py:
build, scoring equals the model's own forward, LoRA targets cover attention and MLP, one GRPO
step, checkpoint reload, optionally vLLM); every diffusers pipeline replica gets diffusion.py's
checks. The results are the support matrix (matrix.py): grouprl/replicas/support_matrix.json
and docs/support_matrix.md, which grouprl consults when a config names a model
(grouprl/policies/support.py).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    from grouprl.replicas.sweep import matrix as mx
    from grouprl.replicas.sweep.run import run_sweep, sweep_meta, targets

    parser = argparse.ArgumentParser(prog="python -m grouprl.replicas sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="model types, architecture classes or pipeline replica names; the "
                        "other rows of the existing matrix are kept")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--limit-s", type=float, default=180.0,
                        help="time limit per architecture in seconds (default 180)")  # fmt: skip
    parser.add_argument("--vllm", action="store_true",
                        help="also compare vLLM's log-probs after a weight push (slow)")  # fmt: skip
    parser.add_argument("--journal", type=Path, default=None,
                        help="JSON-lines file of finished rows: written as the sweep goes, and "
                        "read at start so an interrupted sweep resumes")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for support_matrix.json and support_matrix.md (default: the "
                        "package's JSON and docs/support_matrix.md)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    try:
        rows = targets(args.only)
    except ValueError as e:
        parser.error(str(e))
    json_path = args.out / "support_matrix.json" if args.out else mx.PACKAGE_JSON
    md_path = args.out / "support_matrix.md" if args.out else mx.DOCS_MD
    previous = mx.load_matrix(json_path) if args.only else None
    start = time.monotonic()
    results = run_sweep(rows, jobs=args.jobs, limit_s=args.limit_s, vllm=args.vllm,
                        progress=lambda line: print(line, flush=True),
                        journal=args.journal)  # fmt: skip
    command = "python -m grouprl.replicas sweep " + shlex.join(argv)
    meta = sweep_meta(command.strip(), time.monotonic() - start, args.jobs, args.limit_s)
    if previous is not None:  # a partial rerun: the full sweep's meta stays, this run is noted
        meta = {**previous.get("meta", {}), "last_partial_run": meta}
    matrix = mx.build_matrix(results, meta, previous)
    mx.write_matrix(matrix, json_path, md_path)
    for kind, t in matrix["totals"].items():
        print(f"{kind}: {t['pass_all']} of {t['rows']} pass every check "
              f"({100 * t['share_pass_all']:.1f}%)")  # fmt: skip
    print(f"wrote {json_path} and {md_path}; this run took {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
