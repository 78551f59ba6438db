"""The typed messages between dmdask's parts: a request and a reply dataclass for every
handler, and the small APIs that send them.

`scheduler`: the scheduler plugin's handlers (`SchedulerAPI`, used by clients and the
transparent session). `worker`: the workers' handlers (`WorkerAPI`, used by clients and
other workers). A handler checks what it receives once, where its request is built from
the wire; no message is a bare dict keyed by status strings.
"""
