"""Command line (also `python -m grouprl`):

grouprl train CONFIG.yaml [dotted.key=value ...]   train (`grouprl train --help` lists every key)
grouprl eval CONFIG_OR_RUN [dotted.key=value ...]  held-out metrics of a config's model or a run
grouprl config show [SECTION]                      every option: type, default, allowed, meaning
grouprl list presets|rewards|tasks|workloads|envs  the registries' names, each with a summary
grouprl bench NAME [ARGS ...]                      a benchmark of a source checkout
grouprl convert hpsv2|image_reward --checkpoint F --out DIR   a released scorer as a folder
grouprl vllm-serve --model DIR [--port P ...]      a vLLM server for rollout.engine vllm_server
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from grouprl.config.loading import ConfigError, load_config
from grouprl.runtime.user_inputs import enable_crash_traces


def _train(args: argparse.Namespace) -> int:
    from grouprl.train import train

    cfg = load_config(args.config, args.overrides)
    result = train(cfg)
    key = result["accuracy_key"]
    before, after = result["before"] or {}, result["after"] or {}
    for when, metrics in (("before", before), ("after", after)):
        if "accuracy" in metrics:  # text and agents: a share of problems solved
            print(f"held-out {key} {when}: {100 * metrics['accuracy']:.1f}%")
        elif "reward" in metrics:  # images: the mean weighted reward, in the reward's own units
            print(f"held-out reward {when}: {metrics['reward']:.4f}")
    print(f"run directory: {result['run_dir']}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    """A config file: its model as configured; a run directory: the weights of its newest intact
    checkpoint under the run's config. Prints the held-out metrics (or one JSON object)."""
    import json
    from pathlib import Path

    from grouprl.api import run_evaluation
    from grouprl.runtime.run_state import finished_run, load_weights
    from grouprl.train import NOTHING_GIVEN, Given
    from grouprl.workloads import build_policy

    target = Path(args.target)
    record: dict = {"config": str(target)}
    if target.is_dir():
        cfg, ckpt, notes = finished_run(target, args.overrides)
        for note in notes:
            print(f"grouprl: {note}", file=sys.stderr)

        def trained(cfg, device):  # the run's policy with the checkpoint's weights
            policy = build_policy(cfg, device)
            load_weights(ckpt, policy)
            return policy

        given = Given(policy=trained)
        record = {"run_dir": str(target), "checkpoint": str(ckpt)}
    else:
        cfg, given = load_config(target, args.overrides), NOTHING_GIVEN
    metrics, _ = run_evaluation(cfg, given)
    if args.json:
        print(json.dumps({**record, "metrics": metrics}))
    else:
        print(f"evaluated: {record.get('checkpoint', target)}")
        for key, value in metrics.items():
            print(f"{key}: {value:.4f}")
    return 0


def _config_show(args: argparse.Namespace) -> int:
    from grouprl.config.docs import show_text

    sys.stdout.write(show_text(args.section))
    return 0


def summary_line(obj: object) -> str:
    """The first sentence of `obj`'s docstring's first paragraph ("" without a docstring); the
    module's when the docstring says "See the module docstring"."""
    doc = (getattr(obj, "__doc__", None) or "").strip()
    paragraph = " ".join(doc.split("\n\n")[0].split())
    # a sentence ends at ". " before a capital letter, not inside "e.g. X" / "i.e. X"
    first = re.split(r"(?<!e\.g\.)(?<!i\.e\.)(?<=[.!?])\s+(?=[A-Z])", paragraph, maxsplit=1)[0]
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    if first.startswith("See the module docstring") and module is not None:
        return summary_line(module)  # a class that defers to its module's docstring
    return first


def registry_listing(kind: str) -> list[tuple[str, str]]:
    """(name, one-line summary) for each entry of a registry, in registration order."""
    if kind == "presets":
        from grouprl.config.presets import PRESETS

        return [(name, " ".join(p.summary.split())) for name, p in PRESETS.items()]
    if kind == "rewards":
        import grouprl.workloads  # noqa: F401  (registers the rewards built on policies: vlm_judge)
        from grouprl.envs.rewards import REWARDS

        return [(name, summary_line(fn)) for name, fn in REWARDS.items()]
    if kind == "tasks":
        from grouprl.envs.tasks import TASKS

        return [(name, summary_line(fn)) for name, fn in TASKS.items()]
    if kind == "workloads":
        import grouprl.workloads  # noqa: F401  (importing the package registers the workloads)
        from grouprl.workloads.base import WORKLOADS

        return [
            (name, getattr(cls, "summary", None) or summary_line(cls))
            for name, cls in WORKLOADS.items()
        ]
    if kind == "envs":
        import gymnasium

        import grouprl.envs  # noqa: F401  (importing it registers the gymnasium ids)

        out = []
        for env_id, spec in gymnasium.registry.items():
            if spec.namespace != "grouprl":
                continue
            entry = spec.entry_point
            if isinstance(entry, str):
                entry = gymnasium.envs.registration.load_env_creator(entry)
            out.append((env_id, summary_line(entry)))
        return out
    raise ValueError(f"unknown registry {kind!r}; valid: {', '.join(LISTS)}")


LISTS = ("presets", "rewards", "tasks", "workloads", "envs")


def _list(args: argparse.Namespace) -> int:
    for name, summary in registry_listing(args.kind):
        print(f"{name}\t{summary}")
    return 0


# `grouprl bench NAME`: the scripts in the repository's benchmarks/ folder (not installed with the
# package; a source checkout is needed)
BENCHMARKS = {
    "text-vs-trl": "text_vs_trl.py",
    "learning-vs-trl": "learning_vs_trl.py",
    "hardware-limit": "hardware_limit.py",
    "logprob-memory": "logprob_memory.py",
    "flow-step": "flow_step.py",
    "engines-hf-vs-vllm": "engines_hf_vs_vllm.py",
    "async-speedup": "async_speedup.py",
    "http-reward-overlap": "http_reward_overlap.py",
    "tree-agents": "tree_agents.py",
    "server-scaling": "server_scaling.py",
    "async-bounded": "async_bounded.py",
}


def _convert(args: argparse.Namespace) -> int:
    """`grouprl convert hpsv2 | image_reward`: a released scorer checkpoint as a folder its
    reward loads (the checkpoint read without arbitrary unpickling)."""
    if args.kind == "hpsv2":
        from grouprl.envs.rewards.openclip_convert import convert_openclip

        out = convert_openclip(
            args.checkpoint, args.out, args.processor, args.vision_heads or 16,
            args.text_heads or 16,
        )  # fmt: skip
    else:
        from grouprl.envs.rewards.image_reward import convert_image_reward

        if args.tokenizer is None:
            raise ValueError("convert image_reward needs --tokenizer (a BERT-uncased folder)")
        out = convert_image_reward(
            args.checkpoint, args.out, args.tokenizer, args.vision_heads or 16,
            args.text_heads or 12,
        )  # fmt: skip
    print(f"wrote {out} (reward options: {{model: {out}}})")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / BENCHMARKS[args.name]
    if not script.is_file():
        raise FileNotFoundError(
            f"benchmark script {str(script)!r} not found: `grouprl bench` runs the scripts of a "
            "source checkout of grouprl (git clone, then pip install -e .)"
        )
    return subprocess.run([sys.executable, str(script), *args.options], check=False).returncode


def _vllm_serve(args: argparse.Namespace) -> int:
    from grouprl.policies.text.engines.server.serve import serve  # imports vllm

    return serve(args)


def main(argv: list[str] | None = None) -> int:
    # a crash of the interpreter (a reward or env calling into C that segfaults) prints every
    # thread's Python stack to stderr, so the message names the user function that crashed
    enable_crash_traces()
    parser = argparse.ArgumentParser(
        prog="grouprl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    from grouprl.config.docs import help_listing

    t = sub.add_parser(
        "train",
        help="train a policy from a YAML config",
        description="Train a policy from a YAML config; dotted.key=value overrides follow it.",
        epilog=help_listing(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("config", help="path to the YAML config")
    t.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.lr=1e-4")
    t.set_defaults(func=_train)
    e = sub.add_parser(
        "eval",
        help="evaluate on the held-out split: a config's model, or a run's latest checkpoint",
    )
    e.add_argument("target", metavar="CONFIG_OR_RUN", help="a YAML config or a run directory")
    e.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. eval.pass_k=4")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=_eval)
    config = sub.add_parser("config", help="describe the config's options")
    config_sub = config.add_subparsers(dest="action", required=True)
    show = config_sub.add_parser(
        "show",
        help="every option of the config (or of one section): type, default, allowed, meaning",
        description="Print every option of the config, or of one section: its dotted key, type, "
        "allowed values, default and description, read from the config models.",
    )
    show.add_argument(
        "section", nargs="?", default=None, help="a section, dotted for nested ones (rollout.vllm)"
    )
    show.set_defaults(func=_config_show)
    lister = sub.add_parser(
        "list",
        help="the names a config can use, each with a one-line summary",
        description="One name per line, a TAB, a one-line summary.",
    )
    lister.add_argument("kind", choices=LISTS, help="which registry")
    lister.set_defaults(func=_list)
    bench = sub.add_parser(
        "bench",
        help="run a benchmark of benchmarks/ (table, JSON and PNG in benchmarks/results)",
        description="Run a script of benchmarks/ (a source checkout); ARGS go to the script.",
    )
    bench.add_argument("name", choices=list(BENCHMARKS), help="which benchmark")
    bench.add_argument("options", nargs=argparse.REMAINDER, help="passed to the script")
    bench.set_defaults(func=_bench)
    convert = sub.add_parser(
        "convert",
        help="convert a released scorer checkpoint into a folder its reward loads (no pickle)",
        description="hpsv2: an OpenCLIP ViT-H-14 checkpoint (HPS_v2*_compressed.pt) into a "
        "transformers CLIPModel folder; image_reward: ImageReward.pt (BLIP) into BLIP towers + "
        "its head. Checkpoints are read with torch.load(weights_only=True).",
    )
    convert.add_argument("kind", choices=["hpsv2", "image_reward"], help="what the checkpoint is")
    convert.add_argument("--checkpoint", required=True, help="the .pt / .safetensors file")
    convert.add_argument("--out", required=True, help="the folder to write")
    convert.add_argument(
        "--processor", default=None,
        help="a local CLIP processor folder to copy (e.g. laion/CLIP-ViT-H-14-laion2B-s32B-b79K)",
    )  # fmt: skip
    convert.add_argument(
        "--tokenizer", default=None, help="image_reward: a local bert-base-uncased folder"
    )
    convert.add_argument(
        "--vision-heads", type=int, default=None, help="default 16 (ViT-H-14; BLIP ViT-L)"
    )
    convert.add_argument(
        "--text-heads", type=int, default=None, help="default 16 (hpsv2), 12 (image_reward)"
    )
    convert.set_defaults(func=_convert)
    from grouprl.policies.text.engines.server.serve import add_arguments

    serve = sub.add_parser(
        "vllm-serve",
        help="serve a vLLM engine over HTTP with a weight-update channel (rollout.engine "
        "vllm_server)",
        description="A vLLM engine in its own process: POST /generate (token ids in, ids, "
        "log-probs and weight versions out) and the weight channel trainers push to "
        "(grouprl/policies/text/engines/server/app.py).",
    )
    add_arguments(serve)
    serve.set_defaults(func=_vllm_serve)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:
        # `grouprl list rewards | head -1`: the reader left; stop quietly (stdout now goes nowhere,
        # so the interpreter's final flush does not raise again)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ConfigError, ValueError, FileNotFoundError, RuntimeError) as err:
        # bad input (config, data, model path, non-finite loss, a checkpoint that cannot be
        # trusted, user code that exited: train.UserCodeExit): one clear message, no traceback
        # wall; GROUPRL_DEBUG=1 shows the traceback for bug reports
        if os.environ.get("GROUPRL_DEBUG"):
            raise
        print(f"grouprl: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
