"""Where a resumed iterator starts (`resume_point`): its own state, or every rank's states
of another run. Every refusal is a `SpecError` naming what differs, or the field of a
state edited into something no iterator writes (`check_state`)."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import SpecError
from ..plan.order import ORDER_VERSION, RankShare

# what a resume state must share with the iterator it resumes (rank, world and batch size may differ)
STATE_FIELDS = ("identity", "epoch", "seed", "shuffle", "shuffle_window", "drop_last", "window")


def resume_point(resume, spec, current: dict, share: Callable[[int, int, int, list[dict]], RankShare]) -> tuple:
    """(history, position) for the iterator of `spec` whose own state is `current`: the
    generations of ranks before this one in the epoch (`dmdask.plan.elastic`), and the
    batches of this rank's share handed out (0 when every rank's states of another world or
    batch size start a new generation). share(rank, world_size, batch_size, history): a
    rank's `RankShare`."""
    states = [resume] if isinstance(resume, dict) else list(resume) if isinstance(resume, (list, tuple)) else []
    if not states or not all(isinstance(s, dict) and "position" in s for s in states):
        raise SpecError("resume", "a dict from BatchIterator.state_dict(), or the list of every rank's "
                        "state_dict() (for another world size)", resume)
    num_samples = share(spec.rank, spec.world_size, spec.batch_size, []).order.num_samples
    for state in states:
        check_state(state, num_samples)
        _check_matches(state, current)
    worlds = {(s.get("world_size"), s.get("batch_size")) for s in states}
    if isinstance(resume, dict) or worlds == {(spec.world_size, spec.batch_size)}:
        mine = [s for s in states if s.get("rank") == spec.rank]
        if len(mine) != 1 or (mine[0].get("world_size"), mine[0].get("batch_size")) != \
                (spec.world_size, spec.batch_size):
            theirs = states[0]
            raise SpecError("resume", f"the state of rank {spec.rank} of {spec.world_size} with batch_size="
                            f"{spec.batch_size} (this state is of rank {theirs.get('rank')!r} of "
                            f"{theirs.get('world_size')!r}, batch_size={theirs.get('batch_size')!r}); to "
                            "resume with another world or batch size pass the list of every rank's state",
                            f"{len(states)} state(s)")
        state = mine[0]
        history = state.get("history", [])
        return history, _check_position(state, share(spec.rank, spec.world_size, spec.batch_size, history))
    if len(worlds) != 1:
        raise SpecError("resume", "the states of one run: they disagree on world_size/batch_size", sorted(worlds))
    (world, batch), = worlds
    ranks = sorted(s.get("rank") for s in states)
    if ranks != list(range(world)) or any(s.get("history", []) != states[0].get("history", []) for s in states):
        raise SpecError("resume", f"every rank's state of one run: ranks 0..{world - 1} once each, taken at the "
                        "same checkpoint", f"ranks {ranks}")
    history = states[0].get("history", [])
    consumed = []
    for state in sorted(states, key=lambda s: s["rank"]):
        old = share(state["rank"], world, batch, history)
        consumed.append(min(_check_position(state, old) * batch, old.num_samples))
    return history + [{"world_size": world, "consumed": consumed}], 0


def _is_int(low):
    return lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and v >= low


_FIELDS = {  # a state's fields: (type check, what it must be)
    "order": (_is_int(0), "an integer (the order's version)"),
    "identity": (lambda v: isinstance(v, str) and bool(v), "the dataset's identity (a string)"),
    "epoch": (_is_int(0), "an integer >= 0"),
    "seed": (_is_int(0), "an integer >= 0"),
    "shuffle": (lambda v: isinstance(v, bool), "True or False"),
    "shuffle_window": (lambda v: v is None or _is_int(1)(v), "None or an integer >= 1"),
    "rank": (_is_int(0), "an integer >= 0, below world_size"),
    "world_size": (_is_int(1), "an integer >= 1"),
    "batch_size": (_is_int(1), "an integer >= 1"),
    "drop_last": (lambda v: isinstance(v, bool), "True or False"),
    "position": (_is_int(0), "an integer >= 0"),
    "window": (lambda v: v is None or (isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_int(1)(x) for x in v)),
               "None or [length, stride] of the spec's window"),
    "history": (lambda v: isinstance(v, (list, tuple)), "a list of {'world_size', 'consumed'} generations"),
}


def check_state(state: dict, num_samples: int) -> None:
    """`SpecError` naming the field unless `state` has only the keys, types and ranges of a `state_dict()`."""
    unknown = sorted(set(state) - set(_FIELDS))
    if unknown:
        raise SpecError(f"resume[{unknown[0]!r}]", f"only the keys of a state_dict(): {sorted(_FIELDS)}",
                        state[unknown[0]])
    for name, (ok, allowed) in _FIELDS.items():
        if name not in state and name in ("history", "window"):  # "window": not in states of rows from before it
            continue
        if name not in state or not ok(state[name]):
            raise SpecError(f"resume[{name!r}]", allowed, state.get(name, "<missing>"))
    if state["rank"] >= state["world_size"]:
        raise SpecError("resume['rank']", f"an integer in 0..{state['world_size'] - 1} (world_size)", state["rank"])
    left = num_samples
    for i, generation in enumerate(state.get("history", [])):
        field = f"resume['history'][{i}]"
        if not isinstance(generation, dict) or set(generation) != {"world_size", "consumed"}:
            raise SpecError(field, "a dict of 'world_size' and 'consumed'", generation)
        world, consumed = generation["world_size"], generation["consumed"]
        listed = isinstance(consumed, (list, tuple))
        if not listed or not _is_int(1)(world) or len(consumed) != world:
            raise SpecError(f"{field}['world_size']", f"an integer >= 1, the length of 'consumed' "
                            f"({len(consumed) if listed else 'not a list'})", world)
        for r, c in enumerate(consumed):
            most = len(range(r, left, world))
            if not _is_int(0)(c) or c > most:
                raise SpecError(f"{field}['consumed'][{r}]", f"an integer in 0..{most} (rank {r}'s share of the "
                                f"{left} positions left)", c)
        left -= sum(int(c) for c in consumed)


def _check_matches(state: dict, current: dict) -> None:
    if state.get("order") != ORDER_VERSION:
        raise SpecError("resume", f"a state of this dmdask's epoch order (version {ORDER_VERSION}); this one "
                        "comes from another order's version (an older dmdask): resume at the next epoch's start instead",
                        state.get("order"))
    for name in STATE_FIELDS:
        if state.get(name) != current.get(name):
            raise SpecError("resume", f"a state of the same dataset and spec ({name} is "
                            f"{current.get(name)!r} here but {state.get(name)!r} in the state)", state.get(name))


def _check_position(state: dict, share: RankShare) -> int:
    """The state's position (an integer >= 0, `check_state`) if within the rank's share."""
    position = int(state["position"])
    if position > len(share):
        raise SpecError("resume", f"a position in 0..{len(share)}", position)
    return position
