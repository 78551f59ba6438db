"""`python -m benchmarks run --quick|--full [--only traffic,...]`, `python -m benchmarks run --peers
--quick|--full` (dmdask beside other loaders, and the simulation: their own results file, merged into
the page) and `python -m benchmarks report FILE`."""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import logging
import os
import sys
import time
import traceback
import warnings

from . import report
from .common import machine

SCENARIOS = ["traffic", "training", "throughput", "control_plane", "scale", "transparent", "cold", "gpu", "peer_path",
             "faults", "first_contact", "token_corpus", "science_windows"]
PEER_SCENARIOS = ["peers", "simulate"]  # `run --peers`: results in peers-<preset>-latest.json
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def run(preset: str, only, out_dir: str = RESULTS, write_doc: bool = True, peers: bool = False) -> dict:
    warnings.filterwarnings("ignore")
    compile_dmdask()
    logging.getLogger("distributed").setLevel(logging.ERROR)
    flag = "--peers " if peers else ""
    results = {"preset": preset, "machine": machine(), "scenarios": {},
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "command": f"python -m benchmarks run {flag}--{preset}" + (f" --only {','.join(only)}" if only else "")}
    earlier = _earlier(out_dir, preset, peers) if only else None
    for name in only or (PEER_SCENARIOS if peers else SCENARIOS):
        started = time.perf_counter()
        print(f"[benchmarks] {name} ({preset}) ...", flush=True)
        try:
            results["scenarios"][name] = importlib.import_module(f"benchmarks.{name}").run(preset)
        except Exception as exc:  # one broken scenario must not hide the others
            traceback.print_exc()
            results["scenarios"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        results["scenarios"][name]["seconds"] = time.perf_counter() - started
        print(f"[benchmarks] {name}: {results['scenarios'][name]['seconds']:.0f} s", flush=True)
    if earlier:  # `--only`: the other scenarios keep their latest results, each with its own run's date
        for name, result in earlier["scenarios"].items():
            if name not in results["scenarios"]:
                results["scenarios"][name] = dict(result, run=result.get("run") or earlier["date"])
    os.makedirs(out_dir, exist_ok=True)
    results["file"] = f"{'peers-' if peers else ''}{preset}-latest.json"
    with open(os.path.join(out_dir, results["file"]), "w") as f:
        json.dump(results, f, indent=1, default=float)
    if write_doc:
        main_file = os.path.join(out_dir, f"{preset}-latest.json")
        if peers and os.path.exists(main_file):  # the page keeps the other scenarios' latest results
            with open(main_file) as f:
                page = report.write(json.load(f), peers=results)
        else:
            page = report.write(results) if not peers else report.write(dict(results, scenarios={}), peers=results)
        print(f"[benchmarks] wrote {page}")
    return results


def compile_dmdask() -> None:
    """dmdask's bytecode, as `pip install` writes it for the loaders dmdask is compared
    with: an editable install under PYTHONDONTWRITEBYTECODE (set on this machine) compiles
    every module again in every new process, inside the clock where a module is first
    imported in an epoch (`import dmdask` 0.38 s -> 0.19 s, a rank's first `open_source`
    42 -> 32 ms)."""
    import compileall

    import dmdask
    compileall.compile_dir(os.path.dirname(dmdask.__file__), quiet=1)


def _earlier(out_dir: str, preset: str, peers: bool):
    """The latest results file of this preset, or None."""
    path = os.path.join(out_dir, f"{'peers-' if peers else ''}{preset}-latest.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the scenarios and regenerate docs/benchmarks.md")
    size = r.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", dest="preset", const="quick", help="under 10 minutes")
    size.add_argument("--full", action="store_const", dest="preset", const="full", help="about an hour")
    r.add_argument("--peers", action="store_true",
                   help=f"run {PEER_SCENARIOS} instead (dmdask beside other loaders; `make bench-peers`)")
    r.add_argument("--only", default="", help=f"comma-separated subset of {SCENARIOS} (with --peers: of "
                                               f"{PEER_SCENARIOS})")
    rep = sub.add_parser("report", help="regenerate docs/benchmarks.md from a results file")
    rep.add_argument("file")
    args = parser.parse_args(argv)
    if args.command == "report":
        print(report.main(args.file))
        return 0
    only = [s for s in args.only.split(",") if s]
    choices = PEER_SCENARIOS if args.peers else SCENARIOS
    unknown = set(only) - set(choices)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {choices}")
    run(args.preset or "quick", only, peers=args.peers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
