"""`glob` as the target filesystem answers it (the same paths or infos in the same order,
given the same listings), over a `DmdaskFileSystem`'s own cached `find`: by HTTP's rules
(`HTTPFileSystem._glob`: a listing's folders match `dir/*`; "?" starts a URL's query) or the
generic ones (`AbstractFileSystem.glob`), fsspec 2024-2026. The generic glob over a chained
filesystem drops HTTP's folders and finds nothing for a pattern ending in "/".
"""
from __future__ import annotations

import glob as _glob_module
import os
import re

from fsspec.utils import glob_translate


def glob(fs, path: str, maxdepth=None, url_rules: bool = False, **kwargs):
    """The paths of `fs` (a `DmdaskFileSystem`) matching `path`, by HTTP's rules if `url_rules`."""
    if maxdepth is not None and maxdepth < 1:
        raise ValueError("maxdepth must be at least 1")
    seps = ("/",) if url_rules else ((os.path.sep, os.path.altsep) if os.path.altsep else (os.path.sep,))
    ends_with_sep = path.endswith(seps)
    path = fs.target_path(path)  # as the target strips it (a local path loses its trailing slash)
    stars = ("/**", "/*") if url_rules else tuple(sep + "**" for sep in seps)
    append_slash_to_dirname = ends_with_sep or path.endswith(stars)
    magic = "*[" if url_rules else "*?["
    min_idx = min([path.find(c) for c in magic if c in path] or [len(path)])
    detail = kwargs.pop("detail", False)
    withdirs = True if url_rules else kwargs.pop("withdirs", True)
    if not (re.search(r"[*\[]", path) if url_rules else _glob_module.has_magic(path)):
        if fs.exists(path, **kwargs):
            return {path: fs.info(path, **kwargs)} if detail else [path]
        return {} if detail else []
    root = ""
    if "/" in path[:min_idx]:
        min_idx = path[:min_idx].rindex("/")
        root = path[:min_idx + 1]
    depth = path[min_idx + 1:].count("/") + 1
    if "**" in path:
        if maxdepth is not None:
            depth = depth - (path[path.find("**"):].count("/") + 1) + maxdepth
        else:
            depth = None
    if root and not url_rules:
        root = fs.target_path(root)  # as the generic find gets it from a target that strips slashes
    allpaths = fs.find(root, maxdepth=depth, withdirs=withdirs, detail=True, **kwargs)
    pattern = re.compile(glob_translate(path + ("/" if ends_with_sep else "")))
    if url_rules:
        out = {(p.rstrip("/") if not append_slash_to_dirname and info["type"] == "directory" and p.endswith("/")
                else p): info
               for p, info in sorted(allpaths.items()) if pattern.match(p.rstrip("/"))}
    else:
        out = {p: info for p, info in sorted(allpaths.items())
               if pattern.match(p + "/" if append_slash_to_dirname and info["type"] == "directory" else p)}
    return out if detail else list(out)
