"""`TieredStore`, the `data=` mapping of a dmdask worker (their room: `dmdask.worker.tier_space`)."""
from __future__ import annotations

import errno
import logging
import shutil
import tempfile
from collections.abc import Callable, MutableMapping

from dask.utils import format_bytes

from ..shm.arena import Arena, all_fixed
from ..source import is_block_key, parse_block_key
from .folders import make_folder, remove_stale
from .holdings import ArenaBlock, Block, FileBlock, GroupHeld, Holding
from .tier_space import TierSpace

logger = logging.getLogger(__name__)


def _from(source: str | None) -> str:
    return f" (from {source})" if source else ""


class TieredStore(TierSpace, MutableMapping):
    """Worker storage: dmdask blocks in a RAM or SSD tier (a `Streamed` marker for one that
    fits no tier), every other key in a dict. Use stays within capacity plus the blocks
    being read right now (`TierSpace.reserve`). Like every Dask worker mapping it never
    drops a key on its own."""

    def __init__(self, ram: int, ssd: int = 0, ssd_dir: str | None = None, shm_dir: str | None = None,
                 gid: int | None = None):
        super().__init__(ram, ssd)
        self.gid = gid  # the group that may read the tiers' files too (`dmdask.shm.modes`); None: none
        self._roots = {"ram": shm_dir or None, "ssd": ssd_dir}
        self._folders: dict[str, str] = {}
        self._arenas: dict[str, Arena] = {}  # dataset identity -> its RAM blocks' arena
        self._blocks: dict[str, Holding] = {}
        self._tier_of: dict[str, str] = {}
        self._other: dict[str, object] = {}
        self._reservations: dict[str, tuple] = {}  # key -> (tier, bytes) placed, not yet stored
        self.on_block: Callable[[str], None] | None = None  # called with each block key stored

    def place(self, key: str, tier: str, block, reserved: int, reader=None):
        """The value the worker will store under `key` for a read block with room reserved:
        a `FileBlock` (keeping `reader`, to read the block again) or `ArenaBlock` (in shared
        memory for RAM, on the SSD), the block itself for RAM when it is a `FillingBlock` or
        the worker has no shared-memory folder; None when the device refused the write (the
        tier stops growing) or the tier's folder cannot be made (it takes no more blocks).
        The reservation turns into held bytes when the worker stores the value."""
        if isinstance(block, Block) and (tier == "ssd" or self._roots["ram"]):
            try:
                self.folder(tier)
            except OSError as exc:
                self.unreserve(tier, reserved)
                self._unusable(tier, exc)
                return None
            try:
                if tier == "ram" and all_fixed(block):
                    block = self._into_arena(key, block)
                else:
                    block = FileBlock.write(self.folder(tier), block, tier, reader)
            except OSError as exc:
                with self._lock:
                    stats = getattr(self, tier)
                    stats.reserved -= reserved
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                        stats.full = True
                return None
        with self._lock:
            self._reservations[key] = (tier, reserved)
        return block

    def _into_arena(self, key: str, block: Block) -> ArenaBlock:
        """`block` copied into its dataset's shared-memory arena (made on first use)."""
        identity, index = parse_block_key(key)
        with self._lock:
            arena = self._arenas.get(identity)
        if arena is None or not arena.fits(block):
            block_len = block.start // index if index else len(block)
            arena = Arena(self.folder("ram"), identity, block_len, block)
            with self._lock:
                arena = self._arenas.setdefault(identity, arena)
        return ArenaBlock(arena, arena.write(block), block.start, block.stop, block.nbytes)

    def default_ssd_root(self, root: str) -> None:
        """Where the SSD tier goes when no `ssd_dir` was given (the worker's local directory)."""
        with self._lock:
            self._roots["ssd"] = self._roots["ssd"] or root

    def open_ssd(self) -> str | None:
        """Make the SSD tier's folder now, so that an unusable `ssd_dir` shows at start:
        such a tier takes no blocks and the worker runs on; the reason is logged as a
        warning, kept in `stats()["ssd"]["error"]` and returned (None: usable or no tier)."""
        if self.ssd.capacity > 0:
            try:
                self.folder("ssd")
            except OSError as exc:
                self._unusable("ssd", exc)
        return self.ssd.error

    def check_shared_memory(self) -> str | None:
        """Warn (at worker start) when the RAM tier's capacity exceeds the free room of its
        shared-memory file system (blocks beyond it are streamed); the warning is kept in
        `stats()["ram"]["warning"]` and returned; None when the tier fits."""
        root = self._roots["ram"]
        if not root or self.ram.capacity <= 0:
            return None
        try:
            total, _, free = shutil.disk_usage(root)
        except OSError:
            return None  # made when first used; `place` reports what goes wrong then
        if self.ram.capacity <= free:
            return None
        self.ram.warning = (
            f"the RAM tier ({format_bytes(self.ram.capacity)}) does not fit in {root} "
            f"({format_bytes(free)} free of {format_bytes(total)}): blocks beyond "
            f"{format_bytes(free)} are streamed from the shared store; enlarge {root} (docker --shm-size, "
            "a tmpfs size) or lower dmdask.worker.ram")
        logger.warning("dmdask: %s", self.ram.warning)
        return self.ram.warning

    def describe(self) -> str:
        """One line: each tier's capacity and folder (and what is wrong with it)."""
        ram_where = f"in {self._roots['ram']}" if self._roots["ram"] else "in the worker's memory (no shm-dir)"
        parts = [f"RAM {format_bytes(self.ram.capacity)} {ram_where}" + _from(self.ram.source)]
        parts.append(f"SSD {format_bytes(self.ssd.capacity)} in {self._roots['ssd']}{_from(self.ssd.source)}"
                     if self.ssd.capacity else "no SSD tier")
        mode = "this user only" if self.gid is None else f"group {self.gid}"
        return "; ".join(parts) + f"; files readable by {mode}"

    def _unusable(self, tier: str, exc: OSError) -> None:
        root = self._roots[tier] or tempfile.gettempdir()
        reason = f"cannot use {root!r} for the {tier} tier: {exc.strerror or exc}"  # the same on every worker
        with self._lock:
            getattr(self, tier).error = reason
        logger.warning("dmdask %s tier takes no blocks from now on (they go to the next tier with room, "
                       "or are streamed from the shared store): %s", tier, reason)

    def folder(self, tier: str) -> str:
        """This worker's folder of a tier, made on first use (`dmdask.worker.folders`)."""
        with self._lock:
            if tier not in self._folders:
                self._folders[tier] = make_folder(self._roots[tier] or tempfile.gettempdir(), tier, self.gid)
            return self._folders[tier]

    def root(self, tier: str) -> str | None:
        """The folder a tier's own folder is made in (None: RAM in the worker's memory)."""
        with self._lock:
            return self._roots[tier]

    def shared_folder(self) -> str | None:
        """This worker's shared-memory folder (made on first use); None when it keeps RAM
        blocks in its own memory."""
        return self.folder("ram") if self._roots["ram"] else None

    # -- MutableMapping ---------------------------------------------------------------
    def __setitem__(self, key, value):
        if is_block_key(key) and isinstance(value, Holding):
            self._discard_block(key)
            self._blocks[key] = value
            self._other.pop(key, None)
            if self.on_block is not None:
                self.on_block(key)
            tier = value.tier
            if tier is None:  # streamed: in no tier
                return
            # Charged here, whether placed by `load_block` (its reservation is released)
            # or brought by Dask itself (a graceful retirement moving blocks: RAM).
            self._tier_of[key] = tier
            with self._lock:
                placed_tier, reserved = self._reservations.pop(key, (tier, 0))
                getattr(self, placed_tier).reserved -= reserved
                stats = getattr(self, tier)
                stats.bytes += value.nbytes
                stats.blocks += 1
                stats.samples += value.samples
        else:
            self._discard_block(key)
            self._other[key] = value

    def holdings(self, keys: list) -> list:
        """The block held under each key (None where no block is), in one pass: a row
        request names every block its rows are in, up to one per row."""
        return list(map(self._blocks.get, keys))

    def __getitem__(self, key):
        if key in self._blocks:
            return self._blocks[key]
        return self._other[key]

    def __delitem__(self, key):
        if key in self._blocks:
            self._discard_block(key)
        else:
            value = self._other.pop(key)
            if isinstance(value, GroupHeld):  # a load group released: its blocks with it
                for member in value.keys:
                    self._discard_block(member)

    def _discard_block(self, key) -> None:
        value = self._blocks.pop(key, None)
        tier = self._tier_of.pop(key, None)
        if tier is None:
            return
        with self._lock:
            stats = getattr(self, tier)
            stats.bytes -= value.nbytes
            stats.blocks -= 1
            stats.samples -= value.samples
        value.release()

    def __contains__(self, key) -> bool:
        return key in self._blocks or key in self._other

    def __iter__(self):
        yield from self._blocks
        yield from self._other

    def __len__(self) -> int:
        return len(self._blocks) + len(self._other)

    def remove_stale(self) -> None:
        """Remove the tier folders of this node's worker processes that no longer run."""
        for root in self._roots.values():
            if root:
                remove_stale(root)

    def close(self) -> None:
        """Remove the tiers' folders (their blocks die with the worker anyway), and those
        of dead workers of this node."""
        for arena in self._arenas.values():
            arena.close()
        for folder in self._folders.values():
            shutil.rmtree(folder, ignore_errors=True)
        self.remove_stale()

    def stats(self) -> dict:
        """Each tier's `TierStats` and `dir` (where its blocks are: this worker's folder once
        made, else its parent; None: RAM in the worker's memory), and the streamed blocks."""
        with self._lock:
            stats = {tier: dict(getattr(self, tier).as_dict(), dir=self._folders.get(tier) or self._roots[tier])
                     for tier in ("ram", "ssd")}
            stats["streamed_blocks"] = len(self._blocks) - len(self._tier_of)  # in no tier; O(1) a heartbeat
        return stats
