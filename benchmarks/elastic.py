"""Elastic restarts: does a job that loses a rank (kill -9) and comes back with another world size continue
exactly? (A benchmark, not a test; tests/engine/test_elastic.py runs some of its cases.)

Each case starts ``torchrun --nproc-per-node=N0`` on tests/_elastic_script.py (a float64 MLP, a new global batch
size after every step, micro-batches of at most 8, a checkpoint every 4 steps), SIGKILLs one rank at a kill point,
then starts ``torchrun --nproc-per-node=N1``, which resumes from the newest checkpoint in the folder and trains to
the end. Kill points: ``mid-epoch`` (the first micro-batch of a step), ``mid-accumulation`` (the second micro-batch
of a step), ``after-decision`` (in a callback right after a step's decision, before that step's checkpoint) and
``checkpoint-write`` (inside the checkpoint write, after the temporary file is synced, before the atomic rename:
the previous checkpoint must be the one that loads). A ``sigterm`` row sends SIGTERM to one rank of a run with
``save_on_sigterm=True`` (a planned stop) instead. The ``node killed`` and ``node joins`` rows run torchrun's own
elastic restarts: two "nodes" (``torchrun --nnodes=1:2``, c10d rendezvous on 127.0.0.1) of which one is SIGKILLed,
and one node that a second joins (its agent SIGTERMs the worker, which saves).

Reported per case, against an uninterrupted run: samples lost and repeated (the multiset of sample ids the
resumed job trained, over all its steps, against the uninterrupted run's; target 0), whether every step's size is
the same, the steps trained twice (between the last checkpoint and the kill), and the largest difference of the
final weights and of the per-step losses from the uninterrupted run at the first world size (0.0 means bitwise
equal; with another world size the gradients are summed in another order, so the difference is rounding).

    PYTHONPATH=src python benchmarks/elastic.py --out bench-out/elastic [--quick]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "_elastic_script.py"
STEPS = 30
# kill point -> the script's --kill POINT:STEP (kill steps avoid the checkpoint steps 4, 8, ... except "write")
KILL_POINTS = {"mid-epoch": "step:13", "mid-accumulation": "micro:17", "after-decision": "decision:16",
               "checkpoint-write": "write:20"}
CHANGES = {"2->1": (2, 1), "1->2": (1, 2), "2->2": (2, 2)}


def torchrun(out: Path, nproc: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """One ``torchrun --standalone --nproc-per-node=nproc`` job of the worker script (no restarts)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=0", str(SCRIPT), str(out), "--steps", str(STEPS), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def node(out: Path, *args: str, endpoint: str, host: bool, nnodes: str = "1:2", run_id: str = "elastic",
         env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """One torchrun "node" (one worker process) of a multi-node job on this machine (:func:`kill_node` kills it).
    c10d rendezvous at ``endpoint``; ``host``: this node serves
    the rendezvous store (on one machine every node would take 127.0.0.1 for its own address and try to). The
    worker's stdout and stderr go to ``out/node-<pid>.txt``."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
           f"--rdzv-conf=is_host={str(host).lower()},last_call_timeout=1", "--max-restarts=3",
           "--monitor-interval=0.2", str(SCRIPT), str(out), "--steps", str(STEPS), *args]
    log = open(out / f"node-{'host' if host else 'peer'}-{time.monotonic_ns()}.txt", "wb")  # noqa: SIM115
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""What an elastic (``--nnodes=MIN:MAX``) job needs with torch 2.13: with the agents' shared TCP store (the
default), a node that joins a running job deadlocks the new rendezvous round (the old rank 0 does not publish the
round's MASTER_ADDR, which the new node waits for; both wait 60 s and fail)."""


def kill_node(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a :func:`node`: its agent and every process below it (torchrun starts its workers in sessions of
    their own, so the agent's process group does not hold them; Linux's /proc lists the children)."""
    pids = [proc.pid]
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                pids += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    proc.wait()


def wait_for_steps(out: Path, pattern: str, steps: int, timeout: float = 180) -> None:
    """Wait until a file ``out/pattern`` holds ``steps`` lines."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(out.glob(pattern))
        if files and len(files[0].read_text().splitlines()) >= steps:
            return
        time.sleep(0.05)
    raise TimeoutError(f"no {pattern} with {steps} steps in {out} after {timeout} s")


def reference(out: Path, nproc: int) -> dict[str, Any]:
    """An uninterrupted run on ``nproc`` ranks (its :func:`combined` steps and weights)."""
    out.mkdir(parents=True, exist_ok=True)
    done = torchrun(out, nproc)
    if done.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return combined(out)


def combined(out: Path) -> dict[str, Any]:
    """The steps the job in ``out`` trained, over its attempts (in the order they started): an attempt's steps
    beyond the step the next attempt resumed at were lost and trained again; per step the size, epoch, loss and
    the sample ids of all ranks. Also the attempts' starts, the steps trained twice, and the last weights."""
    starts = sorted(out.glob("start-*.json"), key=lambda p: p.stat().st_mtime_ns)
    tags = [p.stem.removeprefix("start-") for p in starts]
    begins = [json.loads(p.read_text())["step"] for p in starts]
    steps: dict[int, dict[str, Any]] = {}
    redone = 0
    for i, tag in enumerate(tags):
        until = begins[i + 1] if i + 1 < len(tags) else None
        per_rank = [_read_lines(p) for p in sorted(out.glob(f"steps-{tag}-r*.jsonl"))]
        for lines in per_rank:
            for line in lines:
                step = line["step"]
                if until is not None and step > until:
                    if lines is per_rank[0]:
                        redone += 1
                    continue
                entry = steps.setdefault(step, {"size": line["size"], "epoch": line["epoch"], "loss": line["loss"],
                                                "ids": [], "sizes": set()})
                entry["ids"] += line["ids"]
                entry["sizes"].add(line["size"])
    weights_file = out / f"weights-{tags[-1]}.pt" if tags else None
    weights = torch.load(weights_file) if weights_file is not None and weights_file.exists() else None
    ends = [json.loads(p.read_text()) for p in sorted(out.glob(f"end-{tags[-1]}-r*.json"))] if tags else []
    return {"steps": [steps[s] for s in sorted(steps)], "numbers": sorted(steps), "starts": begins,
            "redone": redone, "weights": weights, "ends": ends}


def _read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compare(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Samples lost / repeated, same sizes, weight and loss differences of ``run`` against ``ref``."""
    got = collections.Counter(i for s in run["steps"] for i in s["ids"])
    want = collections.Counter(i for s in ref["steps"] for i in s["ids"])
    lost, repeated = sum((want - got).values()), sum((got - want).values())
    same_steps = run["numbers"] == ref["numbers"] and all(
        sorted(a["ids"]) == sorted(b["ids"]) for a, b in zip(run["steps"], ref["steps"]))
    sizes = [s["size"] for s in run["steps"]] == [s["size"] for s in ref["steps"]] and all(
        len(s["sizes"]) == 1 for s in run["steps"])
    weight_diff = float("nan")
    if run["weights"] is not None and ref["weights"] is not None:
        weight_diff = max(float((a - b).abs().max()) for a, b in zip(run["weights"], ref["weights"]))
    loss_diff = max((abs(a["loss"] - b["loss"]) for a, b in zip(run["steps"], ref["steps"])), default=float("nan"))
    return {"samples_lost": lost, "samples_repeated": repeated, "same_samples_per_step": same_steps,
            "same_sizes": sizes, "steps_redone": run["redone"], "resumed_at": run["starts"][1:],
            "max_weight_diff": weight_diff, "max_loss_diff": loss_diff}


def kill_case(out: Path, point: str, change: str) -> dict[str, Any]:
    """Kill the last rank (rank 0, the writer, for ``checkpoint-write``) at ``point`` in a job of the first world
    size, resume with the second."""
    first, second = CHANGES[change]
    out.mkdir(parents=True, exist_ok=True)
    rank = 0 if point == "checkpoint-write" else first - 1
    killed = torchrun(out, first, "--kill", f"{rank}:{KILL_POINTS[point]}")
    if killed.returncode == 0:
        raise RuntimeError(f"{point} {change}: the killed job exited 0\n{killed.stderr[-2000:]}")
    resumed = torchrun(out, second, "--tag", "b")
    if resumed.returncode != 0:
        raise RuntimeError(f"{point} {change}: the resumed job failed\n{resumed.stdout[-3000:]}{resumed.stderr[-3000:]}")
    return combined(out)


def sigterm_case(out: Path, change: str) -> dict[str, Any]:
    """A planned stop: SIGTERM to the last rank of a job with ``save_on_sigterm=True`` once it has trained 9
    steps (it waits there for the signal: the first step end to see it is step 10's); every rank must save at
    that step end and exit 0; then resume with the second world size."""
    first, second = CHANGES[change]
    out.mkdir(parents=True, exist_ok=True)
    procs = launch(out, first, "--save-on-sigterm", last_rank_args=("--hold-at", "9"))
    signal_when(out, procs[-1], step=9, rank=first - 1)
    codes = wait_all(procs)
    if codes != [0] * first:
        raise RuntimeError(f"sigterm {change}: exit codes {codes}")
    resumed = torchrun(out, second, "--tag", "b")
    if resumed.returncode != 0:
        raise RuntimeError(f"sigterm {change}: the resumed job failed\n{resumed.stderr[-3000:]}")
    return combined(out)


def node_joins_case(out: Path) -> dict[str, Any]:
    """``torchrun --nnodes=1:2`` started on one node, with ``save_on_sigterm=True``; its worker waits after step 6
    until a second node joins: the agent SIGTERMs it to restart both with world size 2 (step 7 is saved, nothing
    is trained twice)."""
    out.mkdir(parents=True, exist_ok=True)
    endpoint = f"127.0.0.1:{free_port()}"
    args = ("--save-on-sigterm", "--hold-at", "6")
    nodes = [node(out, *args, endpoint=endpoint, host=True, env=ELASTIC_ENV)]
    try:
        wait_for_steps(out, "steps-a0w1-r0.jsonl", 6)
        nodes.append(node(out, *args, endpoint=endpoint, host=False, env=ELASTIC_ENV))
        codes = [proc.wait(timeout=240) for proc in nodes]
    finally:
        for proc in nodes:
            if proc.poll() is None:
                kill_node(proc)
    if codes != [0, 0]:
        raise RuntimeError(f"node joins: exit codes {codes} (logs in {out}/node-*.txt)")
    return combined(out)


def node_killed_case(out: Path) -> dict[str, Any]:
    """``torchrun --nnodes=1:2`` on two nodes; the second node's worker waits after step 14 (the first one's in
    step 15's collectives) and that node, agent and worker, is SIGKILLed: the first node's agent restarts its
    worker alone, from the checkpoint of step 12. (The first node serves the rendezvous store: killing it would
    leave the other no rendezvous.)"""
    out.mkdir(parents=True, exist_ok=True)
    endpoint = f"127.0.0.1:{free_port()}"
    host = node(out, endpoint=endpoint, host=True, env=ELASTIC_ENV)
    peer = node(out, "--hold-at", "14", endpoint=endpoint, host=False, env=ELASTIC_ENV)
    try:
        wait_for_steps(out, "steps-a0w2-r*.jsonl", 14)
        kill_node(peer)
        code = host.wait(timeout=240)
    finally:
        for proc in (host, peer):
            if proc.poll() is None:
                kill_node(proc)
    if code != 0:
        raise RuntimeError(f"node killed: the remaining node exited {code} (logs in {out}/node-*.txt)")
    return combined(out)


def launch(out: Path, world_size: int, *args: str, last_rank_args: tuple[str, ...] = ()) -> list[subprocess.Popen[bytes]]:
    """Start ``world_size`` worker processes by hand (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0 serves
    the store), so that a signal can go to one rank; the last rank gets ``last_rank_args`` too."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "LOCAL_RANK": str(rank)}
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        extra = last_rank_args if rank == world_size - 1 else ()
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), str(out), "--steps", str(STEPS), *args, *extra],
                                      env=env,
                                      stdout=subprocess.DEVNULL, stderr=open(out / f"stderr-r{rank}.txt", "wb")))  # noqa: SIM115
    return procs


def signal_when(out: Path, proc: subprocess.Popen[bytes], *, step: int, rank: int, timeout: float = 120) -> None:
    """SIGTERM ``proc`` once rank ``rank`` has logged ``step`` steps."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = sorted(out.glob(f"steps-a0w*-r{rank}.jsonl"))
        if lines and len(lines[0].read_text().splitlines()) >= step:
            proc.send_signal(signal.SIGTERM)
            return
        if proc.poll() is not None:
            raise RuntimeError(f"rank {rank} ended before step {step} (exit code {proc.returncode})")
        time.sleep(0.02)
    raise TimeoutError(f"rank {rank} did not reach step {step} in {timeout} s")


def wait_all(procs: list[subprocess.Popen[bytes]], timeout: float = 120) -> list[int]:
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    return codes


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true",
                        help="three cases: mid-accumulation 2->1, checkpoint-write 2->2, sigterm 2->2 (< 60 s idle)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        cases = [("mid-accumulation", "2->1"), ("checkpoint-write", "2->2"), ("sigterm", "2->2")]
    else:
        cases = [(p, c) for p in KILL_POINTS for c in CHANGES] + [("sigterm", "2->1"), ("sigterm", "2->2"),
                                                                   ("node killed", "2->1"), ("node joins", "1->2")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        refs = {n: reference(Path(tmp, f"ref{n}"), n) for n in sorted({int(c[0]) for _, c in cases})}
        for point, change in cases:
            start = time.perf_counter()
            where = Path(tmp, f"{point.replace(' ', '-')}-{change.replace('->', 'to')}")
            elastic = {"node killed": node_killed_case, "node joins": node_joins_case}.get(point)
            if elastic is not None:
                run = elastic(where)
            elif point == "sigterm":
                run = sigterm_case(where, change)
            else:
                run = kill_case(where, point, change)
            row = {"kill_point": point, "change": change, **compare(run, refs[int(change[0])]),
                   "seconds": round(time.perf_counter() - start, 1)}
            rows.append(row)
            print(_row_text(row), flush=True)
    (args.out / "elastic.json").write_text(json.dumps({"steps": STEPS, "rows": rows}, indent=1))
    table = table_text(rows)
    (args.out / "elastic.md").write_text(table + "\n")
    print("\n" + table)


def _row_text(row: dict[str, Any]) -> str:
    return (f"{row['kill_point']:>17} {row['change']}: lost {row['samples_lost']} repeated {row['samples_repeated']} "
            f"sizes {'same' if row['same_sizes'] else 'DIFFER'} redone {row['steps_redone']} "
            f"max|dw| {row['max_weight_diff']:.1e} ({row['seconds']} s)")


def table_text(rows: list[dict[str, Any]]) -> str:
    """The markdown table of docs/distributed.md."""
    lines = ["| kill point | ranks | resumed at step | steps redone | samples lost | samples repeated | "
             "same sizes | same samples per step | max abs weight diff | max abs loss diff |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kill_point']} | {r['change']} | {', '.join(map(str, r['resumed_at']))} | "
                     f"{r['steps_redone']} | {r['samples_lost']} | {r['samples_repeated']} | "
                     f"{'yes' if r['same_sizes'] else 'no'} | {'yes' if r['same_samples_per_step'] else 'no'} | "
                     f"{r['max_weight_diff']:.1e} | {r['max_loss_diff']:.1e} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
