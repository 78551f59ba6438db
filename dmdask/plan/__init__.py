"""The plan of an epoch: which sample goes where, computed per batch.

`dmdask.plan.order` maps any position of an epoch to its sample id in O(1) time and
memory (a keyed permutation, never an array over all samples), and cuts the epoch into
each rank's batches on demand. Modules here are pure numpy: no cluster, no dask.
"""
