"""`dmdask.internals` against the distributed release installed: each reach into Dask's
internals checked on Dask's own state machines (no cluster needed: these are Dask's
in-process objects, not mocks), so a release that changes one fails here."""
from distributed.worker_state_machine import ComputeTaskEvent, Execute, ExecuteSuccessEvent, WorkerState

from dmdask.internals import run_next


def _executed(instructions) -> list:
    return [i.key for i in instructions if isinstance(i, Execute)]


def test_run_next_moves_queued_tasks_ahead_in_the_order_asked_and_keeps_the_state_valid():
    """Ten tasks queued on a one-thread worker in the scheduler's order; a rank asks for
    t7, then t4 for an earlier batch: once the running task ends, t4 runs, then t7, then
    the others in the scheduler's order. Dask's own validation checks the state after
    every event; a task not queued (running, unknown) is left alone."""
    state = WorkerState(nthreads=1, validate=True)
    keys = [f"t{i}" for i in range(10)]
    first = state.handle_stimulus(*(ComputeTaskEvent.dummy(k, priority=(i,), stimulus_id="s") for i, k in
                                    enumerate(keys)))
    assert _executed(first) == ["t0"]
    assert run_next(state, ["t7"], 5) == ["t7"]
    assert run_next(state, ["t4", "t0", "nope"], 1) == ["t4"]  # t0 runs already; "nope" is unknown
    assert run_next(state, ["t7"], 9) == []  # moved already, for an earlier batch
    order = []
    running = "t0"
    while running is not None:
        done = state.handle_stimulus(ExecuteSuccessEvent.dummy(running, stimulus_id="s"))
        order.append(running)
        started = _executed(done)
        running = started[0] if started else None
    assert order == ["t0", "t4", "t7", "t1", "t2", "t3", "t5", "t6", "t8", "t9"]
