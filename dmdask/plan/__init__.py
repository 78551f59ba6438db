"""The plan of an epoch: which sample goes where, computed per batch, in O(1) time and memory
per position (`dmdask.plan.order`). Modules here are pure numpy: no cluster, no dask.
"""
