"""The typed messages to the handlers of the scheduler plugin (`scheduler`, `SchedulerAPI`) and
of the workers (`worker`, `WorkerAPI`), each request checked once, where it is received."""
