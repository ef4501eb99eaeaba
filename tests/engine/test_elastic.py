"""Elastic membership with real processes: a rank SIGKILLed at a kill point, the job restarted with fewer or more
ranks (a new torchrun, or torchrun --nnodes=1:2 itself when a node leaves or joins), resumes from the last
checkpoint: every remaining sample trained exactly once, the same size at every step, and the weights of an
uninterrupted run (bitwise on the same world size; to rounding on another, which sums gradients in another order).
The jobs are tests/_elastic_script.py; benchmarks/elastic.py launches and compares them."""

from __future__ import annotations

import json

import pytest
from _benchmarks import load_benchmark

pytestmark = pytest.mark.distributed
elastic = load_benchmark("elastic")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return elastic.reference(tmp_path_factory.mktemp("uninterrupted"), 2)


def check_exact(run: dict, ref: dict, *, same_world: bool) -> dict:
    result = elastic.compare(run, ref)
    assert result["samples_lost"] == 0 and result["samples_repeated"] == 0, result
    assert result["same_sizes"] and result["same_samples_per_step"], result
    assert run["ends"] and all(end["step"] == elastic.STEPS for end in run["ends"])
    if same_world:
        assert result["max_weight_diff"] == 0.0 and result["max_loss_diff"] == 0.0, result
    else:
        assert result["max_weight_diff"] < 1e-12 and result["max_loss_diff"] < 1e-12, result
    return result


@pytest.mark.parametrize(("point", "change", "resumed_at"), [
    ("mid-accumulation", "2->1", 16),  # killed in the second micro-batch of step 18
    pytest.param("after-decision", "1->2", 12, marks=pytest.mark.slow),  # after step 16's decision, before its save
    pytest.param("checkpoint-write", "2->2", 16, marks=pytest.mark.slow),  # inside the write of step 20's checkpoint
])
def test_a_rank_killed_and_the_job_restarted_with_another_world_size_continues_exactly(tmp_path, reference, point,
                                                                                         change, resumed_at):
    run = elastic.kill_case(tmp_path, point, change)
    assert run["starts"] == [0, resumed_at]
    check_exact(run, reference, same_world=change == "2->2")
    if point == "checkpoint-write":
        # Killed between the temporary file and the rename: that file is left (removed by a later save once a
        # minute old), and the resume took the previous checkpoint, step 16.
        assert list((tmp_path / "checkpoints").glob(".step-000000020.pt.tmp-*"))


@pytest.mark.slow
def test_torchrun_elastic_a_node_joins_the_running_job_sigterm_saves_and_two_ranks_continue(tmp_path, reference):
    """torchrun --nnodes=1:2 with one node: a second node joins, the agent SIGTERMs its worker to restart both
    with world size 2; save_on_sigterm loses no step (the restart resumes at the step the SIGTERM ended)."""
    run = elastic.node_joins_case(tmp_path)
    stopped = json.loads((tmp_path / "end-a0w1-r0.json").read_text())
    assert stopped == {"step": 7, "preempted": True} and run["starts"] == [0, 7] and run["redone"] == 0
    assert json.loads((tmp_path / "start-a0w2.json").read_text())["world_size"] == 2
    check_exact(run, reference, same_world=False)


@pytest.mark.slow
def test_torchrun_elastic_a_node_killed_the_other_continues_alone_from_the_last_checkpoint(tmp_path, reference):
    """torchrun --nnodes=1:2 with two nodes; one node (agent and worker) is SIGKILLed mid-run: the other node's
    agent restarts its worker, which resumes alone from the last checkpoint."""
    run = elastic.node_killed_case(tmp_path)
    assert json.loads((tmp_path / "start-a1w1.json").read_text())["world_size"] == 1
    assert run["starts"] == [0, 12] and run["redone"] == 2  # the checkpoint of step 12; steps 13 and 14 trained again
    check_exact(run, reference, same_world=False)
