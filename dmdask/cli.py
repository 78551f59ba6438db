"""The `dmdask` command: `dmdask demo [...]`, `dmdask status SCHEDULER`, `dmdask mount URL
MOUNTPOINT` and `dmdask --help`."""
from __future__ import annotations

import sys
from collections import defaultdict

DEFAULT_PORT = 8786  # a scheduler's, as `dask scheduler` listens by default
SCHEDULER_HELP = ("scheduler address: HOST, HOST:PORT (default port 8786), tcp://HOST:PORT or tls://HOST:PORT "
                  "(default: dask config dmdask.fs.scheduler, then scheduler-address)")


class UsageError(ValueError):
    """A command-line argument that cannot be used; the message is one line."""


def scheduler_address(given=None) -> str:
    """The scheduler to connect to, as `dmdask status` and `dmdask mount` take it: `given`,
    else the dask config `dmdask.fs.scheduler`, else `scheduler-address`. HOST and
    HOST:PORT mean tcp:// (port 8786 by default); a dashboard's http(s):// URL is a
    `UsageError` saying so."""
    import dask.config
    from distributed.comm.addressing import parse_host_port, unparse_host_port

    value = given or dask.config.get("dmdask.fs.scheduler", None) or dask.config.get("scheduler-address", None)
    if not value:
        raise UsageError("no scheduler given: pass its address (e.g. tcp://host:8786), or set the dask config "
                         "dmdask.fs.scheduler (DASK_DMDASK__FS__SCHEDULER)")
    value = str(value).strip()
    if value.startswith(("http://", "https://")):
        host = value.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[0]
        raise UsageError(f"{value} is a dashboard (HTTP) address; give the scheduler's, e.g. "
                         f"tcp://{host}:{DEFAULT_PORT}")
    if "://" in value:
        return value
    try:
        host, port = parse_host_port(value, default_port=DEFAULT_PORT)
    except ValueError as exc:
        raise UsageError(f"{value!r} is not a scheduler address ({exc})") from None
    return f"tcp://{unparse_host_port(host, port)}"


def _fail(command: str, message, code: int = 1) -> int:
    """Say why `dmdask COMMAND` failed (one line on stderr); its exit status."""
    print(f"dmdask {command}: {message}", file=sys.stderr)
    return code


def status(args) -> int:
    """Print the per-worker tier table of a running cluster."""
    import distributed

    import dmdask

    try:
        address = scheduler_address(args.address or args.scheduler)
    except UsageError as exc:
        return _fail("status", exc, 2)
    security = None
    if args.tls_ca_file or args.tls_cert:
        security = distributed.Security(tls_ca_file=args.tls_ca_file, tls_client_cert=args.tls_cert,
                                        tls_client_key=args.tls_key, require_encryption=True)
    try:
        with distributed.Client(address, timeout=args.timeout, security=security) as client:
            stats = dmdask.stats(client)
            dashboard = client.dashboard_link
    except (OSError, TimeoutError, ValueError) as exc:
        return _fail("status", f"cannot reach the scheduler at {address}: {type(exc).__name__}: {exc}")
    except TypeError as exc:  # distributed's way of saying tls:// lacks its certificates
        return _fail("status", f"cannot connect to {address}: {exc}; pass --tls-ca-file, --tls-cert and --tls-key")
    except dmdask.NotADmdaskWorker as exc:
        return _fail("status", exc)
    if stats["workers"]:
        print(format_table(stats))
        for line in format_warnings(stats):
            print(line)
    else:
        print(f"workers: none (the scheduler at {address} has no workers; start them with "
              f"`dask worker {address} --worker-class dmdask.Worker`)")
    print()
    print(format_datasets(stats["datasets"]))
    if stats["workers"]:
        print()
        print("\n".join(format_tiers(stats)))
    if dashboard:
        print(f"\ndashboard page: {tiers_page(dashboard)} (with `dask scheduler --preload dmdask.dashboard`)")
    return 0


def tiers_page(dashboard_link: str) -> str:
    """The dmdask page next to the dashboard's status page."""
    return dashboard_link.rsplit("/", 1)[0] + "/dmdask"


def mount(args) -> int:
    """Serve a folder of the store read-only at a mount point, through the cluster's cache."""
    from .fs.mount import mount as serve

    try:
        scheduler = scheduler_address(args.scheduler)
    except UsageError as exc:
        return _fail("mount", exc, 2)
    try:
        serve(args.url, args.mountpoint, scheduler=scheduler, block_size=args.block_size, debug=args.debug)
    except (RuntimeError, OSError) as exc:
        return _fail("mount", exc)
    return 0


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _hit_rate(s: dict) -> str:
    served = s["ram"]["hits"] + s["ssd"]["hits"] + s["stream"]["hits"]
    return f"{100 * (s['ram']['hits'] + s['ssd']['hits']) / served:.0f}%" if served else "-"


# (header, value of one row's stats): every column right-aligned but the first
COLUMNS = [
    ("RAM MiB", lambda s: _mib(s["ram"]["bytes"])),
    ("/ cap", lambda s: _mib(s["ram"]["capacity"])),
    ("SSD MiB", lambda s: _mib(s["ssd"]["bytes"])),
    ("/ cap", lambda s: _mib(s["ssd"]["capacity"])),
    ("RAM blocks", lambda s: str(s["ram"]["blocks"])),
    ("SSD blocks", lambda s: str(s["ssd"]["blocks"])),
    ("streamed", lambda s: str(s["streamed_blocks"])),
    ("RAM hits", lambda s: str(s["ram"]["hits"])),
    ("SSD hits", lambda s: str(s["ssd"]["hits"])),
    ("streamed hits", lambda s: str(s["stream"]["hits"])),
    ("hit rate", _hit_rate),
    ("store MiB", lambda s: _mib(s["shared_store"]["bytes"])),
    ("requests", lambda s: str(s["shared_store"]["requests"])),
    ("peer in MiB", lambda s: _mib(s["peer"]["bytes_in"])),
]


def format_table(stats: dict) -> str:
    """The table of `dmdask.stats(client)`: one row per worker (sorted) and the total."""
    rows = sorted(stats["workers"].items()) + [("total", stats["total"])]
    cells = [["worker"] + [h for h, _ in COLUMNS]]
    cells += [[name] + [fn(s) for _, fn in COLUMNS] for name, s in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
        for row in cells
    )


def format_tiers(stats: dict) -> list:
    """One line per worker and tier: its folder and where its size came from (`dmdask.worker.sizing`)."""
    lines = []
    for worker, s in sorted(stats["workers"].items()):
        for tier in ("ram", "ssd"):
            where = s[tier].get("dir") or ("the worker's memory" if tier == "ram" else "-")
            lines.append(f"{worker} {tier}: {where}; size from {s[tier].get('source') or '-'}")
    return lines


def format_warnings(stats: dict) -> list:
    """One line per distinct tier warning or error of the workers, naming how many workers it concerns."""
    seen = defaultdict(list)
    for worker, s in sorted(stats["workers"].items()):
        for tier in ("ram", "ssd"):
            for kind in ("warning", "error"):
                if s[tier].get(kind):
                    seen[f"{tier} {kind}: {s[tier][kind]}"].append(worker)
    return [f"{text} ({len(workers)} of {len(stats['workers'])} workers)" for text, workers in seen.items()]


def format_datasets(datasets) -> str:
    """The registry of `dmdask.stats(client)["datasets"]`: one line per dataset, and one per
    folder of the files read in transparent mode (`dmdask.stats.dataset_rows`, as the
    dashboard groups them). URLs are shown without credentials."""
    from .stats import dataset_rows

    if not datasets:
        return "datasets: none yet (they appear when a training process first iterates over one)"
    lines = ["dataset  samples  blocks  loaded  erred  url"]
    for d in dataset_rows(datasets):
        name, url = (d["name"], d["url"]) if d["files"] is None else (f"{d['files']:,} files", f"{d['url']} (dmdask::)")
        lines.append(f"{name}  {_count(d['samples'])}  {d['blocks']:,}  {d['loaded']:,}  {d['erred']:,}  {url}")
    return "\n".join(lines)


def _count(n) -> str:
    return "-" if n is None else f"{n:,}"


DESCRIPTION = """dmdask: a shared RAM + SSD block cache on Dask workers that feeds training loops.

commands:
  demo     train a small model on scikit-learn's digits through a local dmdask
           cluster and report what came from RAM, SSD and the shared store
  status   the per-worker tier table and the datasets of a running cluster
  mount    a read-only FUSE mount of a store folder, read through the cluster's cache

`dmdask COMMAND --help` gives each command's options.
"""


def _parser():
    """`dmdask` and its commands, each a subparser whose `run` takes the parsed options."""
    import argparse

    from . import __version__, demo

    parser = argparse.ArgumentParser(prog="dmdask", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"dmdask {__version__}")
    commands = parser.add_subparsers(metavar="COMMAND", help="demo, status or mount")
    demo.add_arguments(commands.add_parser("demo", description=demo.DESCRIPTION, epilog=demo.EPILOG)
                       ).set_defaults(run=demo.command)
    p = commands.add_parser("status", description="per-worker tiers of a dmdask cluster")
    p.add_argument("address", nargs="?", default=None, metavar="SCHEDULER", help=SCHEDULER_HELP)
    p.add_argument("--scheduler", default=None, help="the same, as `dmdask mount` takes it")
    p.add_argument("--timeout", type=float, default=10, help="seconds to wait for the scheduler (default 10)")
    for flag, what in (("--tls-ca-file", "CA certificate"), ("--tls-cert", "client certificate"),
                       ("--tls-key", "client key")):
        p.add_argument(flag, default=None, help=f"tls:// schedulers: the {what} file (default: dask config "
                       "distributed.comm.tls)")
    p.set_defaults(run=status)
    p = commands.add_parser("mount", description="a read-only FUSE mount of URL at MOUNTPOINT whose reads go "
                            "through the dmdask cluster's cache (as dmdask:: URLs do); runs until unmounted "
                            "(fusermount3 -u MOUNTPOINT) or interrupted")
    p.add_argument("url", help="folder on the shared store, e.g. https://host/train or s3://bucket/train")
    p.add_argument("mountpoint", help="an existing empty folder")
    p.add_argument("--scheduler", default=None, help=SCHEDULER_HELP)
    p.add_argument("--block-size", default=None, help='cached byte blocks of large files (default "4 MiB")')
    p.add_argument("--debug", action="store_true", help="libfuse's debug output")
    p.set_defaults(run=mount)
    return parser


def main(argv=None) -> int:
    """Run a command; its exit status (2 for a command line argparse rejects, or none)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or what argparse rejects
        return int(exc.code or 0)
    if "run" not in args:
        parser.print_help(sys.stderr)
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
