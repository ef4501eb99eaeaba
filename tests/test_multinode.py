"""Multi-node without a home-made launcher: two torchrun "nodes" of one process each on this machine, joined over
TCP (c10d rendezvous, or the static --master-addr/--master-port one), train with a Pilot as one job of two ranks
(docs/distributed.md, "Multi-node")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _benchmarks import load_benchmark
from _elastic_script import SIZES

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[1]
elastic = load_benchmark("elastic")


def node_command(out: Path, node_rank: int, port: int, rendezvous: str) -> list[str]:
    if rendezvous == "c10d":
        # On one machine both nodes take 127.0.0.1 for their own address: say which one serves the store.
        join = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=multinode-test",
                f"--rdzv-conf=is_host={'true' if node_rank == 0 else 'false'}"]
    else:
        join = ["--master-addr=127.0.0.1", f"--master-port={port}"]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
            f"--node-rank={node_rank}", *join, str(elastic.SCRIPT), str(out), "--steps", "8"]


@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_two_torchrun_nodes_of_one_process_train_as_one_job(tmp_path, rendezvous):
    port = elastic.free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    nodes = [subprocess.Popen(node_command(tmp_path, n, port, rendezvous), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    try:
        outputs = [node.communicate(timeout=180)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert json.loads((tmp_path / "start-a0w2.json").read_text())["world_size"] == 2
    ends = [json.loads((tmp_path / f"end-a0w2-r{r}.json").read_text()) for r in (0, 1)]
    assert ends[0]["step"] == ends[1]["step"] == 8
    run = elastic.combined(tmp_path)
    sizes = [12] + [SIZES[s % len(SIZES)] for s in range(1, 8)]
    assert [s["size"] for s in run["steps"]] == sizes and all(len(s["sizes"]) == 1 for s in run["steps"])
    ids = [i for s in run["steps"] for i in s["ids"]]  # 143 samples of an epoch of 157: each at most once
    assert len(ids) == sum(sizes) and len(set(ids)) == len(ids)
    assert all(len(s["ids"]) == s["size"] for s in run["steps"])  # both ranks' shares make up each global batch
