"""scripts/slurm_ddp.sbatch run for real against stand-in `srun` and `scontrol`: the torchrun line each node runs.

The stand-in scontrol writes its second hostname late, as a long node list would: a batch file
that reads only the first line (`| head -n 1`) under `set -o pipefail` dies of SIGPIPE (exit 141).
The stand-in srun does what SLURM does with --ntasks-per-node=1: it runs the command once on
every node of the allocation, with SLURM_NODEID and SLURMD_NODENAME set. The stand-in
`python` records the arguments and environment it was started with, per node.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SRUN = """#!/usr/bin/env bash
set -eu
while [[ "$1" == --* ]]; do echo "$1" >> "$LOG/srun_options"; shift; done
i=0
for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURMD_NODENAME=$node "$@" &
  i=$((i + 1))
done
wait
"""
SCONTROL = """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" && "$3" == "node[07-08]" ]] || { echo "unexpected: $*" >&2; exit 2; }
printf 'node07\\n'
sleep 0.3     # like a long node list: a reader that stops after one line makes this write fail (SIGPIPE)
printf 'node08\\n'
"""
PYTHON = f"""#!{sys.executable}
import json, os, sys
keep = ("SLURMD_NODENAME", "OMP_NUM_THREADS")
with open(os.path.join(os.environ["LOG"], "node" + os.environ["SLURM_NODEID"] + ".json"), "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": {{k: os.environ.get(k) for k in keep}}}}, f)
"""


def stand_ins(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("python", PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def test_each_node_runs_one_torchrun_that_meets_the_others_at_the_first_node(tmp_path):
    bin_dir = stand_ins(tmp_path)
    log = tmp_path / "log"
    log.mkdir()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "OMP_"))},
           "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(log), "PYTHON": str(bin_dir / "python"),
           "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "4242",
           "SLURM_GPUS_ON_NODE": "4", "SLURM_CPUS_PER_TASK": "16"}
    proc = subprocess.run(["bash", "scripts/slurm_ddp.sbatch", "--epochs", "1", "--ckpt-dir", "runs/ckpt"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    # srun gets the task's CPUs itself: since SLURM 22.05 it no longer takes --cpus-per-task from sbatch
    assert {"--kill-on-bad-exit=1", "--cpus-per-task=16"} <= set((log / "srun_options").read_text().split())
    nodes = {json.loads(p.read_text())["env"]["SLURMD_NODENAME"]: json.loads(p.read_text())
             for p in sorted(log.glob("node*.json"))}
    assert sorted(nodes) == ["node07", "node08"]             # one torchrun per node, not one per GPU
    expected = ["-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=4", "--rdzv_id=4242",
                "--rdzv_backend=c10d", "--rdzv_endpoint=node07:29500", "--max_restarts=1",
                "scripts/train_ddp.py", "--epochs", "1", "--ckpt-dir", "runs/ckpt"]
    for name, seen in nodes.items():
        assert seen["argv"] == expected, name               # the same line everywhere: c10d numbers the nodes
        assert seen["env"]["OMP_NUM_THREADS"] == "4"        # 16 CPUs of the task shared by 4 workers


def test_no_allocation_is_an_error_that_says_so(tmp_path):
    bin_dir = stand_ins(tmp_path)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM")},
           "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(tmp_path)}
    proc = subprocess.run(["bash", "scripts/slurm_ddp.sbatch"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and "SLURM_JOB_NODELIST unset" in proc.stderr
    assert not list(tmp_path.glob("node*.json"))
