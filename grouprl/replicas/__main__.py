"""`python -m grouprl.replicas NAME FOLDER` builds one replica; `--list` prints the names;
`python -m grouprl.replicas sweep ...` runs the architecture sweep (grouprl/replicas/sweep/)."""

from __future__ import annotations

import argparse
import sys

from grouprl.replicas import REPLICAS, build_replica


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sweep"]:
        from grouprl.replicas.sweep import main as sweep

        return sweep(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m grouprl.replicas", description=__doc__)
    parser.add_argument("name", nargs="?", help="replica name (see --list)")
    parser.add_argument("folder", nargs="?", help="output folder (created)")
    parser.add_argument("--list", action="store_true", help="print the replica names and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name in sorted(REPLICAS):
            doc = (REPLICAS[name].__doc__ or "").strip().splitlines()
            print(f"{name:24s} {doc[0] if doc else ''}")
        return 0
    if not args.name or not args.folder:
        parser.error("give NAME and FOLDER, or --list")
    if args.name not in REPLICAS:
        parser.error(f"unknown replica {args.name!r}; allowed: {sorted(REPLICAS)}")
    print(build_replica(args.name, args.folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
