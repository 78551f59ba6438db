"""Test helpers for dmdask: synthetic datasets (`datasets`), `SourceTests` (the contract
every source format's tests inherit; imported when first named, as it needs pytest)."""


def __getattr__(name):
    if name == "SourceTests":
        from .sources import SourceTests

        return SourceTests
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
