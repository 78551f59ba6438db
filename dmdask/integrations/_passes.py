"""The epoch bookkeeping the JAX, MXNet and TensorFlow adapters share: `_EpochPasses`.

A loader over `dmdask.batches` that goes epoch after epoch (handing out an epoch's last
batch moves it on to the next), keeps a resumable position (`state_dict` /
`load_state_dict`) and closes the batches in flight. `dmdask.integrations.torch` keeps its own
bookkeeping: its passes do not move the epoch on (`set_epoch` does, as with
`DistributedSampler`).

This module imports numpy and dmdask, and no framework.
"""
from __future__ import annotations

import threading
from typing import Optional

import numpy as np

import dmdask

__all__ = ["_EpochPasses"]


class _EpochPasses:
    """The epoch bookkeeping of a loader over `dmdask.batches`.

    A pass yields the batches of the current epoch from its start point (the epoch's
    first batch, or the position given to `load_state_dict`). Handing out the last batch
    of the epoch moves the loader to the next epoch at once (a consumer that stops
    after a known number of steps still moves on); a pass abandoned part-way leaves the
    epoch and its start point as they were. `set_epoch` picks an epoch explicitly.
    """

    def _init_passes(self, client, spec: dmdask.Spec, epoch: int) -> None:
        self.client = client
        self.spec = spec
        self.epoch = _check_epoch(epoch)
        self._lock = threading.RLock()
        self._start: Optional[dict] = None  # inner state each pass of this epoch starts from
        self._fresh: Optional[dmdask.BatchIterator] = None  # built (by len/load) but not started
        self._current: Optional[dmdask.BatchIterator] = None  # the latest pass of this epoch

    def set_epoch(self, epoch: int) -> None:
        """Iterate `epoch` on the next pass. The epoch the loader is already at changes
        nothing (a loaded position survives); another epoch starts at its first batch."""
        epoch = _check_epoch(epoch)
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

    def _pass(self, repeat: bool = False):
        """One pass: numpy batches of the current epoch; repeat=True goes on with the
        following epochs without end."""
        with self._lock:
            it = self._fresh if self._fresh is not None else self._make()
            self._fresh = None
            if self._current is not None and self._current is not it:
                self._current.close()
            self._current = it
        try:
            while True:
                count, owner = 0, True
                for batch in it:
                    count += 1
                    last = it.state_dict()["position"] >= len(it)
                    if last:  # the epoch is done once its last batch is handed out
                        owner = self._advance(it)
                    yield batch
                    if last:
                        break
                else:
                    if it.state_dict()["position"] < len(it):  # closed part-way
                        return
                    owner = self._advance(it)  # a pass that started at the end of its epoch
                if not owner or not (repeat or count == 0):
                    return
                with self._lock:
                    if self._current is not None:  # another pass or set_epoch took over
                        return
                    it = self._current = self._make()
        finally:
            it.close()  # cancels prefetched batches; the position stays at the last one handed out

    def _advance(self, it: dmdask.BatchIterator) -> bool:
        """Move on to the next epoch after `it`, if `it` is still this loader's pass."""
        with self._lock:
            if self._current is not it:
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

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (of a loader of the same dataset, spec and rank): sets the
        epoch, and each pass of that epoch starts right after the batches handed out
        when the state was taken. Another dataset, spec or rank raises
        `dmdask.SpecError` (a ValueError) here."""
        if not isinstance(state, dict) or "epoch" not in state or "iterator" not in state:
            raise ValueError(f"state must be a dict from {type(self).__name__}.state_dict()")
        epoch = _check_epoch(state["epoch"])
        inner = state["iterator"]
        if inner is not None:
            if not isinstance(inner, dict):
                raise ValueError("state['iterator'] must be None or a dmdask BatchIterator state")
            if inner.get("epoch") != epoch:
                raise ValueError(f"inconsistent state: epoch {epoch} but iterator epoch {inner.get('epoch')!r}")
            inner = dict(inner)
        with self._lock:
            self._close_all()
            self.epoch = epoch
            self._start = inner
            self._fresh = self._make()  # validates the state against this loader's spec now

    def _close_all(self) -> None:
        for it in (self._current, self._fresh):
            if it is not None:
                it.close()
        self._current = self._fresh = None

    def close(self) -> None:
        """Cancel batches in flight. The loader stays usable: the next pass starts anew."""
        with self._lock:
            if self._current is not None:
                self._current.close()  # kept: state_dict() still reports its position
            if self._fresh is not None:
                self._fresh.close()
                self._fresh = None

    def _peek(self) -> dict:
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


def _check_epoch(epoch) -> int:
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
    return int(epoch)
