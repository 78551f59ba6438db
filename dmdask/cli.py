"""The `dmdask` command: `dmdask demo [...]` and `dmdask status SCHEDULER`."""
from __future__ import annotations

import sys


def status(argv) -> int:
    """Print the per-worker tier table of a running cluster."""
    import argparse

    import distributed

    import dmdask

    parser = argparse.ArgumentParser(prog="dmdask status", description="per-worker tiers of a dmdask cluster")
    parser.add_argument("scheduler", help="scheduler address, e.g. tcp://host:8786")
    args = parser.parse_args(argv)
    with distributed.Client(args.scheduler, timeout=10) as client:
        print(format_table(dmdask.stats(client)))
    return 0


def format_table(stats: dict) -> str:
    def mib(n):
        return f"{n / 2**20:9.1f}"

    lines = ["worker                      RAM MiB / cap    SSD MiB / cap  blocks RAM SSD streamed"
             "   hits RAM    SSD stream   store MiB"]
    rows = sorted(stats["workers"].items()) + [("total", stats["total"])]
    for name, s in rows:
        lines.append(
            f"{name[:26]:26s} {mib(s['ram']['bytes'])} /{mib(s['ram']['capacity'])}"
            f" {mib(s['ssd']['bytes'])} /{mib(s['ssd']['capacity'])}"
            f"  {s['ram']['blocks']:6d} {s['ssd']['blocks']:4d} {s['streamed_blocks']:8d}"
            f"  {s['ram']['hits']:9d} {s['ssd']['hits']:6d} {s['stream']['hits']:6d}"
            f"  {mib(s['shared_store']['bytes'])}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": None, "status": status}
    if not argv or argv[0] not in commands:
        print("usage: dmdask {demo,status} [options]   (dmdask demo --help)", file=sys.stderr)
        return 2
    if argv[0] == "demo":
        from .demo import main as demo

        return demo(argv[1:])
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
