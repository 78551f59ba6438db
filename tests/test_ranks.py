"""`dmdask.rank_from_environment`: torchrun's variables, then Slurm's, else one process."""
import pytest

import dmdask


def test_torchrun_then_slurm_then_one_process():
    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "2"}
    assert dmdask.rank_from_environment(torchrun) == dmdask.Rank(3, 8, 1, "torchrun")
    assert dmdask.rank_from_environment({**slurm, **torchrun}).launcher == "torchrun"  # torchrun under srun
    rank = dmdask.rank_from_environment(slurm)
    assert rank == dmdask.Rank(5, 6, 2, "Slurm") and rank.device == "cuda:2"
    assert dmdask.rank_from_environment({}) == dmdask.Rank(0, 1, 0, "none")


def test_bad_values_name_the_variable():
    with pytest.raises(ValueError, match="SLURM_PROCID='x' is not a number"):
        dmdask.rank_from_environment({"SLURM_PROCID": "x", "SLURM_NTASKS": "2"})
    with pytest.raises(ValueError, match=r"RANK=4 is not a rank of WORLD_SIZE=4 \(0..3\)"):
        dmdask.rank_from_environment({"RANK": "4", "WORLD_SIZE": "4"})
