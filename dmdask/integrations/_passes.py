"""The epoch and resume bookkeeping all four adapters share: `EpochPasses`.

This module imports dmdask and no framework.
"""
from __future__ import annotations

import threading
from typing import Iterator, Optional

import dmdask
from dmdask.plan.order import check_int

__all__ = ["EpochPasses"]


class EpochPasses:
    """The epoch bookkeeping of a loader over `dmdask.batches`.

    Guarantees (from `dmdask.batches`): a pass yields the batches of the current epoch,
    in the order fixed by (seed, epoch), from its start point: the epoch's first batch,
    or the position given to `load_state_dict`; across `world_size` ranks every sample
    of an epoch is yielded exactly once. `len()` is the number of batches this rank gets
    per epoch. `state_dict()` records the epoch and the batches handed out, as plain
    values; `load_state_dict()` continues right after them with the batches an
    uninterrupted run would give. `set_epoch` picks an epoch explicitly. The
    epoch-advance policy (`moves_on`, given once) decides the rest:

    - moves_on=True: handing out the last batch of the epoch moves the loader to the
      next epoch at once (a consumer that stops after a known number of steps still
      moves on), starting at its first batch; a pass abandoned part-way leaves the
      epoch and its start point as they were.
    - moves_on=False: the epoch changes only with `set_epoch`. A loaded position serves
      the next pass only; every later pass starts the epoch at its first batch. After
      the last batch, `state_dict()` keeps reporting the finished pass (so a loader
      resumed from it hands out nothing more of that epoch).

    A new pass (`start_pass`) closes the previous one; `peek` takes a batch without moving.
    """

    def __init__(self, client, spec: dmdask.Spec, epoch: int, *, moves_on: bool = True) -> None:
        self.client = client
        self.spec = spec
        self.epoch = check_int("epoch", epoch, 0)
        self._moves_on = moves_on  # the epoch-advance policy (see the class)
        self._lock = threading.RLock()
        self._start: Optional[dict] = None  # inner state the next pass starts from
        self._fresh: Optional[dmdask.BatchIterator] = None  # built (by len/load) but not started
        self._current: Optional[dmdask.BatchIterator] = None  # the latest pass of this epoch

    def set_epoch(self, epoch: int) -> None:
        """Iterate `epoch` on the next pass. The epoch the loader is already at changes
        nothing (a loaded position survives); another epoch starts at its first batch."""
        epoch = check_int("epoch", epoch, 0)
        with self._lock:
            if epoch != self.epoch:
                self._close_all()
                self._start = None
                self.epoch = epoch

    def __len__(self) -> int:
        """Batches this rank gets per epoch (a resumed pass yields only the rest)."""
        with self._lock:
            if self._current is not None:
                return len(self._current)
            if self._fresh is None:
                self._fresh = self._make()
            return len(self._fresh)

    def _make(self) -> dmdask.BatchIterator:
        return dmdask.batches(self.client, self.spec, epoch=self.epoch, resume=self._start)

    def start_pass(self, repeat: bool = False) -> Iterator[dict]:
        """Start a pass now (closing the previous one): an iterator of the numpy batches
        of the current epoch. repeat=True goes on with the following epochs without end
        (where the loader moves on by itself)."""
        with self._lock:
            it = self._fresh if self._fresh is not None else self._make()
            self._fresh = None
            if self._current is not None and self._current is not it:
                self._current.close()
            self._current = it
            if not self._moves_on:
                self._start = None  # a loaded position serves this pass only
        return self._batches(it, repeat)

    def _batches(self, it: dmdask.BatchIterator, repeat: bool):
        try:
            while True:
                count, moved = 0, False
                for batch in it:
                    count += 1
                    last = it.state_dict()["position"] >= len(it)
                    if last:  # the epoch is done once its last batch is handed out
                        moved = self._end_epoch(it)
                    yield batch
                    if last:
                        break
                else:
                    if it.state_dict()["position"] < len(it):  # closed part-way
                        return
                    moved = self._end_epoch(it)  # a pass that started at the end of its epoch
                if not moved or not (repeat or count == 0):
                    return
                with self._lock:
                    if self._current is not None:  # another pass or set_epoch took over
                        return
                    it = self._current = self._make()
        finally:
            it.close()  # cancels prefetched batches; the position stays at the last one handed out

    def _end_epoch(self, it: dmdask.BatchIterator) -> bool:
        """`it` has handed out the last batch of its epoch. Moves the loader on to the next
        epoch if the policy says so and `it` is still this loader's pass; True if it did."""
        with self._lock:
            if not self._moves_on or self._current is not it:
                return False
            self.epoch += 1
            self._start = None
            self._current = None
            return True

    def state_dict(self) -> dict:
        """{"epoch": int, "iterator": dmdask state or None}: plain values (JSON, pickle)."""
        with self._lock:
            if self._current is not None:
                inner = self._current.state_dict()
            else:
                inner = dict(self._start) if self._start is not None else None
            return {"epoch": self.epoch, "iterator": inner}

    def load_state_dict(self, state) -> None:
        """Continue from `state`: sets the epoch, and each pass of that epoch starts right
        after the batches handed out when the state was taken. `state` is this loader's
        `state_dict()` from a run of the same world size, or the list of every rank's
        `state_dict()`, in rank order, from a run of any world size (elastic restart:
        the batches none of those ranks handed out are dealt to this run's ranks). Another
        dataset or spec raises `dmdask.SpecError` (a ValueError) here."""
        states = state if isinstance(state, (list, tuple)) else [state]
        for one in states:
            if not isinstance(one, dict) or "epoch" not in one or "iterator" not in one:
                raise ValueError(f"state must be a dict from {type(self).__name__}.state_dict(), or the list of "
                                 "every rank's")
            if one["iterator"] is not None and not isinstance(one["iterator"], dict):
                raise ValueError("state['iterator'] must be None or a dmdask BatchIterator state")
        epochs = sorted({check_int("epoch", one["epoch"], 0) for one in states})
        if len(epochs) > 1:
            raise ValueError(f"the states are of epochs {epochs}: take every rank's state at the same step "
                             "(with drop_last=True ranks step together)")
        epoch = epochs[0]
        inner = [None if one["iterator"] is None else dict(one["iterator"]) for one in states]
        for one in inner:
            if one is not None and one.get("epoch") != epoch:
                raise ValueError(f"inconsistent state: epoch {epoch} but iterator epoch {one.get('epoch')!r}")
        known = next((one for one in inner if one is not None), None)
        if known is not None:  # a rank that had handed out nothing of the epoch yet
            inner = [dict(known, rank=r, position=0) if one is None else one for r, one in enumerate(inner)]
        with self._lock:
            self._close_all()
            self.epoch = epoch
            self._start = known if known is None or not isinstance(state, (list, tuple)) else inner
            self._fresh = self._make()  # validates the state against this loader's spec now
            if self._start is not None:
                self._start = self._fresh.state_dict()  # this rank's own start, whatever was given

    def _close_all(self) -> None:
        self.close()
        self._current = None

    def close(self) -> None:
        """Cancel batches in flight. The loader stays usable: the next pass starts anew."""
        with self._lock:
            for it in (self._current, self._fresh):
                if it is not None:
                    it.close()
            self._fresh = None  # the current pass is kept: state_dict() still reports its position

    def peek(self) -> dict:
        """One batch of the current epoch, from a separate iterator (no position moves)."""
        probe = dmdask.batches(self.client, self.spec.replace(prefetch=1), epoch=self.epoch)
        try:
            return next(iter(probe))
        finally:
            probe.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
