"""dmdask on the Dask dashboard, a scheduler preload (docs/dashboard.md): `/dmdask`,
`/dmdask/tiers.json` and `dmdask_*` metrics on `/metrics`, all read on the scheduler from
the workers' heartbeat metrics, so watching costs the workers nothing.

Importing this module registers the page (which needs bokeh); `dask_setup` adds the JSON
route, the navigation link, the history sampler and the Prometheus collector.
"""
from __future__ import annotations

import json
import logging
import weakref

from distributed.http.utils import RequestHandler

from . import prometheus
from .figures import monitor

logger = logging.getLogger(__name__)

PAGE = "/dmdask"
JSON_ROUTE = "/dmdask/tiers.json"
_NAV = PAGE.strip("/")


def register_page() -> bool:
    """Put the `/dmdask` page among the dashboard's Bokeh applications for schedulers created
    afterwards (idempotent); False when the dashboard is not available."""
    try:
        from distributed.dashboard.scheduler import applications

        from .page import tiers_doc
    except ImportError as exc:
        logger.info("no /dmdask page: the Dask dashboard is not available (%s)", exc)
        return False
    applications.setdefault(PAGE, tiers_doc)
    return True


register_page()  # at import: a preload is imported before the scheduler builds its dashboard


class TiersHandler(RequestHandler):
    """GET /dmdask/tiers.json: `figures.snapshot` of the scheduler (and the history)."""

    def get(self):
        mon = monitor(self.server)
        out = dict(mon.snapshot())
        if self.get_argument("history", "0") not in ("", "0", "false"):
            out["history"] = list(mon.history)
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.write(json.dumps(out))


def _dashboard_prefix(scheduler) -> str:
    """The scheduler's `--dashboard-prefix` (taken from its Bokeh application)."""
    for app in getattr(getattr(scheduler, "http_application", None), "applications", ()):
        prefix = getattr(app, "prefix", None)
        if isinstance(prefix, str):
            return prefix.rstrip("/")
    return ""


_routed: weakref.WeakSet = weakref.WeakSet()  # schedulers already serving the route


def add_routes(scheduler) -> None:
    """Serve `/dmdask/tiers.json` from the scheduler's HTTP server (idempotent)."""
    application = getattr(scheduler, "http_application", None)
    if application is None or scheduler in _routed:
        return
    route = _dashboard_prefix(scheduler) + JSON_ROUTE
    application.add_handlers(r".*", [(route, TiersHandler, {"dask_server": scheduler})])
    _routed.add(scheduler)


def add_nav_link(scheduler) -> None:
    """List the page in the navigation bar of every dashboard page."""
    try:
        from distributed.dashboard.scheduler import applications, template_variables
    except ImportError:
        return
    if PAGE not in applications or not getattr(scheduler, "http_application", None):
        return
    if not any(PAGE in getattr(app, "app_paths", ()) for app in scheduler.http_application.applications):
        return  # no dashboard, or it was built before the page was registered
    pages = template_variables(scheduler)["pages"]  # memoized: the list every page renders
    if _NAV not in pages:
        pages.insert(pages.index("info") if "info" in pages else len(pages), _NAV)


class ClosedPageFilter(logging.Filter):
    """Drops tornado's "Uncaught exception GET /dmdask/ws" error logged when a browser closed
    the page while its websocket was being written to; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not (record.exc_info and record.exc_info[1] is not None):
            return True
        from tornado.iostream import StreamClosedError
        from tornado.websocket import WebSocketClosedError

        closed = (WebSocketClosedError, StreamClosedError, ConnectionResetError, BrokenPipeError)
        message = record.getMessage()
        return not (message.startswith("Uncaught exception") and f"{PAGE}/ws" in message
                    and isinstance(record.exc_info[1], closed))


def quiet_closed_pages() -> None:
    """Install `ClosedPageFilter` on tornado's application log (idempotent)."""
    log = logging.getLogger("tornado.application")
    if not any(isinstance(f, ClosedPageFilter) for f in log.filters):
        log.addFilter(ClosedPageFilter())


def dask_setup(scheduler) -> None:
    """Preload entry point, run when the scheduler has started."""
    if not hasattr(scheduler, "workers"):  # a worker or a client given this preload
        logger.warning("dmdask.dashboard is a scheduler preload; ignored on %s", type(scheduler).__name__)
        return
    from ..scheduler import install

    install(scheduler)  # the registry the page reads
    add_routes(scheduler)
    add_nav_link(scheduler)
    quiet_closed_pages()
    monitor(scheduler).start()
    prometheus.register(scheduler)


def dask_teardown(scheduler) -> None:
    if not hasattr(scheduler, "workers"):
        return
    prometheus.unregister(scheduler)
    monitor(scheduler).stop()
