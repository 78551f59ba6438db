"""dmdask's scheduler side: the `DatasetsPlugin` (registry, get-or-create, placement, release)."""
from .plugin import DatasetsPlugin

__all__ = ["DatasetsPlugin", "install"]


def install(scheduler) -> None:
    """Add the plugin to a scheduler unless it has one (for preloads, which run before
    the scheduler starts its plugins)."""
    scheduler.add_plugin(DatasetsPlugin(), idempotent=True)
