"""The typed messages between dmdask's parts: a request and a reply dataclass for every
handler of the scheduler plugin (`scheduler`, sent with `SchedulerAPI`) and of the workers
(`worker`, sent with `WorkerAPI`), each request checked once, where it is received."""
