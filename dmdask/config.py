"""The `dmdask` namespace of dask config: defaults from dmdask.yaml, overridden by
YAML files and `DASK_DMDASK__WORKER__RAM=...` style environment variables."""
from __future__ import annotations

import os

import dask.config
import yaml

with open(os.path.join(os.path.dirname(__file__), "dmdask.yaml")) as f:
    defaults = yaml.safe_load(f)


def register() -> None:
    """Put dmdask's defaults into dask's config (idempotent; `import dmdask` does it)."""
    dask.config.update_defaults(defaults)
