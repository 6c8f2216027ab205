"""offloadctl: the command line of offload-coordinator."""

from __future__ import annotations

import argparse
import sys


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offloadctl", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="offload a stack of layers on this node and time it")
    demo.add_argument("--layers", type=_positive, default=8)
    demo.add_argument("--hidden", type=_positive, default=1024)
    demo.add_argument("--batch", type=_positive, default=16)
    demo.add_argument("--step", type=_positive, default=2, help="prefetch slots")
    demo.add_argument("--repeats", type=_positive, default=15)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from coordinator.demo import run_demo

        return run_demo(num_layers=args.layers, hidden=args.hidden, batch=args.batch,
                        step=args.step, repeats=args.repeats)  # fmt: skip
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
