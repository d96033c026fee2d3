"""pretrain.netcheck.nodes_in_job: the node count the multi-node network check goes by."""

from pretrain.netcheck import nodes_in_job


def test_torchrun_agents_win_over_slurms_count_after_an_elastic_shrink():
    # What the survivors of a 3 -> 2 node shrink are told (README, elastic section).
    shrunk = {"SLURM_JOB_NUM_NODES": "3", "SLURM_NNODES": "3", "GROUP_WORLD_SIZE": "2",
              "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}
    assert nodes_in_job(shrunk) == 2


def test_slurm_count_without_torchrun_and_the_world_fallback():
    assert nodes_in_job({"SLURM_JOB_NUM_NODES": "4", "WORLD_SIZE": "32"}) == 4  # srun: one task per rank
    assert nodes_in_job({"SLURM_NNODES": "2"}) == 2
    assert nodes_in_job({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "3"}) == 3  # 3 + 3 + 2
    assert nodes_in_job({}) == 1
    assert nodes_in_job({"GROUP_WORLD_SIZE": "0", "SLURM_JOB_NUM_NODES": "2"}) == 2
