"""Two real gloo processes: exact coverage across ranks, one size per step everywhere, gradients equal to
a single-process reference at the same global batch, with and without DistributedDataParallel; an fp16
GradScaler changes nothing but the scaling (weights and gradient statistics)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import _dist_helpers as h
import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]


def spawn(tmp_path: Path, steps: int, wrap_ddp: bool, micro, amp: str | None = None) -> list[dict]:
    mp.spawn(
        h.worker, args=(2, str(tmp_path / "init"), str(tmp_path), steps, wrap_ddp, micro, amp), nprocs=2, join=True
    )
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("wrap_ddp,micro", [(False, None), (True, 4), (False, 3)])
def test_two_ranks_cover_exactly_agree_on_sizes_and_match_one_process(tmp_path, wrap_ddp, micro):
    steps = 40  # about 4 epochs of 101 samples, crossing epoch ends with 1-sample final batches
    ranks = spawn(tmp_path, steps, wrap_ddp, micro)
    r0, r1 = (r["records"] for r in ranks)
    assert len(r0) == len(r1) == steps
    for a, b in zip(r0, r1):
        assert a["global_size"] == b["global_size"]
        assert a["accumulation_steps"] == b["accumulation_steps"]
        assert abs(len(a["indices"]) - len(b["indices"])) <= 1
        assert len(a["indices"]) + len(b["indices"]) == a["global_size"]
    assert any(len(b["indices"]) == 0 for b in r1), "no ghost micro-batch was exercised"
    # Exact coverage per complete epoch, over both ranks together.
    per_epoch: dict[int, list[int]] = {}
    for a, b in zip(r0, r1):
        per_epoch.setdefault(a["epoch"], []).extend(a["indices"] + b["indices"])
    complete = [e for e in per_epoch if e < max(per_epoch)]
    assert len(complete) >= 3
    for e in complete:
        assert sorted(per_epoch[e]) == list(range(h.NUM_SAMPLES)), e
    # Same sizes and same weights as one process training on the same global batches.
    ref = h.run_reference(steps, micro)
    assert [r["global_size"] for r in ref["records"]] == [r["global_size"] for r in r0]
    assert [sorted(r["indices"]) for r in ref["records"]] == [sorted(a["indices"] + b["indices"]) for a, b in zip(r0, r1)]
    # Gradient-noise estimates: reduced over ranks, so identical on both; measured on every 2nd step.
    # (B_simple itself may be undefined on this tiny, noisy problem: its |G|^2 estimate can be <= 0.)
    assert ranks[0]["noise"] == ranks[1]["noise"] and "stats/trace_cov" in ranks[0]["noise"]
    for w_ref, w0, w1 in zip(ref["weights"], ranks[0]["weights"], ranks[1]["weights"]):
        assert w0 == w1  # ranks hold identical weights
        torch.testing.assert_close(torch.tensor(w0), torch.tensor(w_ref), rtol=1e-9, atol=1e-11)


@pytest.mark.slow
@pytest.mark.parametrize("wrap_ddp", [True, False])
def test_fp16_grad_scaler_over_two_ranks_changes_nothing_but_the_scaling(tmp_path, wrap_ddp):
    # float64 model: autocast casts nothing, so with amp="fp16" only the GradScaler acts. Under DDP the last
    # micro-batch's scaled gradient is read inside the all-reduce; the statistics must divide the scale out.
    steps = 20
    (tmp_path / "fp16").mkdir()
    (tmp_path / "fp32").mkdir()
    scaled = spawn(tmp_path / "fp16", steps, wrap_ddp, 4, amp="fp16")
    plain = spawn(tmp_path / "fp32", steps, wrap_ddp, 4)
    assert scaled[0]["records"] == plain[0]["records"] and scaled[1]["records"] == plain[1]["records"]
    for s_rank, p_rank in zip(scaled, plain):
        assert s_rank["noise"] == pytest.approx(p_rank["noise"], rel=1e-12) and "stats/trace_cov" in s_rank["noise"]
        for a, b in zip(s_rank["weights"], p_rank["weights"]):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-12, atol=1e-14)


def test_example_runs_under_torchrun_and_survives_a_rank_failure(tmp_path):
    """torchrun --nproc-per-node 2 with a rank that dies in the first attempt: the restarted job resumes
    from the last checkpoint and ends with the same sizes and weights as an uninterrupted job."""
    script = REPO / "examples" / "ddp_train.py"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}

    def torchrun(out: Path, *extra: str) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "--max-restarts=1", str(script), "--out", str(out), "--steps", "60", *extra]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    torchrun(tmp_path / "clean")
    torchrun(tmp_path / "faulty", "--fail-at-step", "37")
    clean = json.loads((tmp_path / "clean" / "result.json").read_text())
    faulty = json.loads((tmp_path / "faulty" / "result.json").read_text())
    assert faulty["restarts"] == 1 and clean["restarts"] == 0
    assert faulty["sizes"] == clean["sizes"]
    assert faulty["weights"] == clean["weights"]


@pytest.mark.parametrize(("micro", "wrap_ddp", "own_hook"),
                         [(None, True, False), (32, True, False), (None, False, False), (None, True, True)])
def test_noise_scale_over_two_ranks_matches_the_closed_form(tmp_path, micro, wrap_ddp, own_hook):
    args = (2, str(tmp_path / "init"), str(tmp_path), micro, wrap_ddp, own_hook)
    mp.spawn(h.noise_worker, args=args, nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"noise{r}.json").read_text()) for r in range(2))
    assert r0 == r1
    # Each rank's own gradient (128 samples) is a small batch for free, read by a DDP communication hook
    # or before the engine's all-reduce: no step is split. (With micro-batches of 32: 4 per rank, 2 at
    # each epoch's last batch of 96 samples.) If the user's DDP model has a hook of its own, DDP allows no
    # second one, and measured steps are split in two instead.
    expected = [2] if own_hook else {(None, True): [1], (32, True): [2, 4], (None, False): [1]}[(micro, wrap_ddp)]
    assert r0["accumulation"] == expected
    # With its own hook, the split step's second half is all-reduced inside DDP: only the first is read.
    assert r0["small"] == ([1] if own_hook else {(None, True): [1], (32, True): [2, 4], (None, False): [1]}[(micro, wrap_ddp)])
    assert r0["stats/grad_sq_norm"] == pytest.approx(r0["true_g2"], rel=0.1)
    assert r0["stats/trace_cov"] == pytest.approx(r0["true_tr"], rel=0.1)


def test_a_ddp_model_on_one_process_measures_both_halves_of_a_split_step(tmp_path):
    # torchrun --nproc_per_node=1: DDP's all-reduce over one rank leaves the gradient as it is, so the last
    # half's .grad increment is its own gradient; it used to be taken for an all-reduced one and left out.
    mp.spawn(h.noise_worker, args=(1, str(tmp_path / "init"), str(tmp_path), None, True, False), nprocs=1, join=True)
    r0 = json.loads((tmp_path / "noise0.json").read_text())
    assert r0["accumulation"] == [2] and r0["small"] == [2]
    assert r0["stats/grad_sq_norm"] == pytest.approx(r0["true_g2"], rel=0.1)
    assert r0["stats/trace_cov"] == pytest.approx(r0["true_tr"], rel=0.1)


def test_compiled_ddp_models_sync_once_per_step_and_train_as_eager_ddp(tmp_path):
    # torch.compile(DDP(model)) hides DDP inside the compiled wrapper: the engine must still find it, run
    # the accumulating micro-batches under its no_sync and leave the reduction to it (one all-reduce per
    # step, as eager DDP), and checkpoint the bare module.
    mp.spawn(h.compile_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"compile{r}.json").read_text()) for r in range(2))
    eager = r0["eager"]
    assert eager["allreduces"] < eager["micro_batches"]  # micro-batches of 4: most steps accumulate
    for mode in ("compile(ddp)", "ddp(compile)"):
        run = r0[mode]
        assert run["micro_batches"] == eager["micro_batches"]
        assert run["allreduces"] == eager["allreduces"], mode
        assert run["weights"] == r1[mode]["weights"] == eager["weights"], mode
        assert run["noise"] == eager["noise"] and "stats/trace_cov" in run["noise"]
        assert run["keys"] == eager["keys"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    # With oom_recovery every micro-batch runs under the inner DDP's no_sync and the engine all-reduces.
    recovery = r0["compile(ddp)+oom_recovery"]
    assert recovery["allreduces"] == 0 and recovery["weights"] == r1["compile(ddp)+oom_recovery"]["weights"]
    for w, w_ref in zip(recovery["weights"], eager["weights"]):
        torch.testing.assert_close(torch.tensor(w), torch.tensor(w_ref), rtol=1e-12, atol=1e-14)


def spawn_oom(tmp_path: Path, wrap_ddp: bool, limit0, micro, recovery: bool) -> list[dict]:
    tmp_path.mkdir()
    mp.spawn(h.oom_worker, args=(2, str(tmp_path / "init"), str(tmp_path), wrap_ddp, limit0, micro, recovery),
             nprocs=2, join=True)
    return [json.loads((tmp_path / f"oom{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("wrap_ddp", [False, True])
def test_one_rank_out_of_memory_makes_every_rank_run_the_step_again(tmp_path, wrap_ddp):
    # Rank 0 fits 6 rows, rank 1 any number: rank 0 fails at its share of 20 and at 10; both ranks run the
    # first step again twice (one integer all-reduce per step tells them), then train with micro-batches of 5.
    ranks = spawn_oom(tmp_path / "oom", wrap_ddp, 6, None, True)
    assert [r["replays"] for r in ranks] == [2, 2] and [r["micro"] for r in ranks] == [5, 5]
    assert ranks[0]["weights"] == ranks[1]["weights"] and ranks[0]["noise"] == ranks[1]["noise"]
    # Rank 0's module buffers are broadcast after every step (DDP would do it before a synced forward).
    if wrap_ddp:
        assert ranks[0]["rows"] == ranks[1]["rows"]
    # Bit for bit the run that had micro-batches of 5 from the start.
    reference = spawn_oom(tmp_path / "ref", wrap_ddp, None, 5, True)
    assert [r["replays"] for r in reference] == [0, 0]
    for r, ref in zip(ranks, reference):
        assert r["indices"] == ref["indices"] and r["weights"] == ref["weights"] and r["noise"] == ref["noise"]
    if wrap_ddp:
        # The engine's all-reduce at the step's end gives DDP's own result (its in-backward all-reduce).
        plain = spawn_oom(tmp_path / "plain", True, None, 5, False)
        assert plain[0]["indices"] == ranks[0]["indices"]
        for w, w_ref in zip(ranks[0]["weights"], plain[0]["weights"]):
            torch.testing.assert_close(torch.tensor(w), torch.tensor(w_ref), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("broadcast", [True, False])
def test_set_batch_size_on_rank_0_alone_stops_every_rank_and_broadcast_int_fixes_it(tmp_path, broadcast):
    mp.spawn(h.set_size_worker, args=(2, str(tmp_path / "init"), str(tmp_path), broadcast), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"set{r}.json").read_text()) for r in range(2))
    if broadcast:
        assert r0 == r1 == {"sizes": [4, 4, 8, 8, 8], "error": None, "step": 5}
    else:  # rank 0 trained 8 in the third step, rank 1 still 4: both stop at that step's end, unapplied
        assert r0["sizes"] == [4, 4, 8] and r1["sizes"] == [4, 4, 4]
        for r in (r0, r1):
            assert r["step"] == 2
            assert "different global sizes" in r["error"] and "broadcast_int" in r["error"]


def test_a_checkpoint_rank_0_refuses_is_refused_on_every_rank(tmp_path):
    mp.spawn(h.refuse_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"refuse{r}.json").read_text()) for r in range(2))
    assert "was it replaced" in r0["error"] and "another rank refused it" in r1["error"]
    assert r0["step"] == r1["step"] == 0  # nothing loaded anywhere


def test_the_oom_recovery_benchmark_runs_on_a_tiny_budget(tmp_path):
    out = tmp_path / "bench"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "oom_recovery.py"), "--workload", "synthetic",
                    "--batch", "64", "--steps", "2", "--rounds", "2", "--out", str(out)],
                   check=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")}, timeout=300)
    result = json.loads((out / "results.json").read_text())
    assert [len(v) for v in result["seconds_per_step"].values()] == [2, 2]
    assert all(s > 0 for v in result["seconds_per_step"].values() for s in v)
    assert result["median_round_ratio"] > 0


def test_init_torchrun_under_a_launcher_without_torchruns_store(tmp_path):
    import socket

    with socket.socket() as sock:  # a free port for rank 0's store
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(h.plain_env_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["init"] for r in ranks] == [[0, 2], [1, 2]] and all(r["sum"] == 3.0 for r in ranks)


@pytest.mark.parametrize("oom_recovery", [False, True])
def test_a_parameter_no_rank_used_gets_no_update_when_the_engine_sums_gradients(tmp_path, oom_recovery):
    mp.spawn(h.unused_branch_worker, args=(2, str(tmp_path / "init"), str(tmp_path), oom_recovery), nprocs=2,
             join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["unused_same"] and r["used_moved"] for r in ranks)


def test_the_noise_hook_passes_to_a_later_probe_and_to_a_new_ddp_wrapper(tmp_path):
    mp.spawn(h.hook_handover_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got == {"attached": [True, True], "read": [False, True], "hooked": [True, True]}


def test_the_pilot_checks_and_aligns_the_process_group_it_finds(tmp_path):
    mp.spawn(h.group_setup_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"group{r}.json").read_text()) for r in range(2))
    assert r0["initial"] == r1["initial"]  # a plain model starts from rank 0's weights, as DDP does
    assert r0["trained"] == r1["trained"]
    for r in (r0, r1):
        assert "process group of 1 ranks" in r["subgroup"] and "default group" in r["subgroup"]
        assert "disagree with the process group" in r["swapped"]
        assert r["ddp_alone"] is not None and "pass the bare model (ddp_model.module) with world_size=1" in r["ddp_alone"]
        assert "communication hook" in r["hook"] and "accumulate_grad_batches >= 2" in r["hook"]
    assert r0["solo_sizes"] == [4, 3, 3] and r1["solo_sizes"] == [4, 4, 4, 4, 4]  # each rank decides alone


def test_a_failing_controller_stops_every_rank_after_saving_the_finished_step(tmp_path):
    mp.spawn(h.failing_controller_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"failing{r}.json").read_text()) for r in range(2))
    assert r0["error"].startswith("InvalidDecisionError") and "rank 0's controller failed" in r1["error"]
    assert r0["step"] == r1["step"] == 3
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step-000000003.pt"]
