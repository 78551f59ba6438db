"""Scenario 7's section of docs/benchmarks.md: settings, tables, plot."""
from __future__ import annotations


def report(result: dict, plots_dir: str) -> str:
    return "TODO\n"
