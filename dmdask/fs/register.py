"""Make `dmdask::` URLs open anywhere once `dmdask` is imported: the fsspec protocol
(also registered by the package's `fsspec.specs` entry point), and webdataset's opener
for the scheme, installed when `webdataset.gopen` is (or already was) imported; and the
run token the job's processes share (`dmdask.fs.run`)."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

import fsspec

from . import PROTOCOL, gopen
from .forks import keep_across_forks
from .run import start

WEBDATASET_OPENERS = "webdataset.gopen"


def register() -> None:
    keep_across_forks()  # a forked child keeps its parent's filesystems working
    start()
    fsspec.register_implementation(PROTOCOL, "dmdask.fs.DmdaskFileSystem", clobber=True)
    if WEBDATASET_OPENERS in sys.modules:
        _add_opener(sys.modules[WEBDATASET_OPENERS])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(WEBDATASET_OPENERS, _add_opener))


def _add_opener(module) -> None:
    module.gopen_schemes.setdefault(PROTOCOL, gopen)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `then(module)` once module `name` has been imported (one time; the module
    is found and loaded by the other finders, as it would be without this one)."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_then(module):
            exec_module(module)
            then(module)

        spec.loader.exec_module = exec_then
        return spec
