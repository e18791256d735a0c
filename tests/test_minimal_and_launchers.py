"""scripts/: self-contained imports, minimal_ddp.py under torchrun, multi-node and SLURM launch files."""
import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from ddp_lab.engine import launch

SCRIPTS = Path(launch.script("x")).parent
ALLOWED_TOP = {"torch", "torchvision"} | set(sys.stdlib_module_names)
ALLOWED_LAZY = {"sklearn", "tqdm"}  # only inside a function: the digits loader, the optional progress bar


def imports(tree):
    """(module, at_top_level) for every import statement."""
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        for name in names:
            yield name.split(".")[0], id(node) in top


def test_scripts_import_only_torch_and_the_standard_library():
    files = sorted(SCRIPTS.glob("*.py"))
    assert {"train_ddp.py", "minimal_ddp.py"} <= {f.name for f in files}
    for f in files:
        for mod, top in imports(ast.parse(f.read_text())):
            assert mod != "ddp_lab", f"{f.name} imports ddp_lab: scripts must run when copied alone"
            allowed = ALLOWED_TOP if top else ALLOWED_TOP | ALLOWED_LAZY
            assert mod in allowed, f"{f.name} imports {mod}"


def test_minimal_ddp_two_ranks(tmp_path):
    out = tmp_path / "minimal.pt"
    run = launch.torchrun("minimal_ddp.py", nproc=2, stream=False, env={"MINIMAL_DDP_OUT": str(out)})
    losses = [float(m.group(1)) for l in run.rank_lines[0] if (m := re.match(r"epoch \d loss ([\d.]+)", l))]
    assert len(losses) == 3 and losses[-1] < losses[0] * 0.8, losses
    assert not any(l.startswith("epoch") for l in run.rank_lines.get(1, []))  # rank 0 prints
    state = torch.load(out, weights_only=True)  # saved unwrapped: no "module." prefix
    assert sorted(state) == ["1.bias", "1.weight", "3.bias", "3.weight"]  # Flatten is layer 0
    assert (SCRIPTS / "minimal_ddp.py").read_text().count("\n") <= 125


def no_comment_after_continuation(path):
    for n, line in enumerate(path.read_text().splitlines(), 1):
        # `cmd \  # note` ends the command at the comment: the engineering article's torchrun bug
        if line.lstrip().startswith("#"):
            continue
        assert not re.search(r"\\\s+#", line), f"{path.name}:{n}: comment after a line continuation"


def dry_run(path, env, *args):
    proc = subprocess.run(["bash", str(path), *args], env={**os.environ, "DRY_RUN": "1", **env},
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout)


def test_multinode_launcher_dry_run_and_missing_settings():
    path = SCRIPTS / "launch_multinode.sh"
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    no_comment_after_continuation(path)
    cmd = dry_run(path, {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "head", "NPROC_PER_NODE": "4"},
                  "--epochs", "2")
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    for flag in ("--nnodes=2", "--node_rank=1", "--nproc_per_node=4", "--master_addr=head", "--master_port=29500"):
        assert flag in cmd
    assert cmd[-3:] == [str(SCRIPTS / "train_ddp.py"), "--epochs", "2"]
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "MASTER_ADDR")}
    proc = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "set NODE_RANK" in proc.stderr


def test_slurm_batch_file_dry_run(tmp_path):
    path = SCRIPTS / "slurm_ddp.sbatch"
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    no_comment_after_continuation(path)
    text = path.read_text()
    assert "#SBATCH --ntasks-per-node=1" in text  # one torchrun per node, not one per GPU
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\nprintf 'node07\\nnode08\\n'\n")
    (fake / "scontrol").chmod(0o755)
    cmd = dry_run(path, {"PATH": f"{fake}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[07-08]",
                         "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "4242", "SLURM_GPUS_ON_NODE": "4"},
                  "--epochs", "1")
    assert cmd[0] == "srun"
    for flag in ("--nnodes=2", "--nproc_per_node=4", "--rdzv_id=4242", "--rdzv_backend=c10d",
                 "--rdzv_endpoint=node07:29500"):
        assert flag in cmd
    assert cmd[-3:] == ["scripts/train_ddp.py", "--epochs", "1"]


def test_multinode_launcher_runs_two_nodes_on_localhost(tmp_path):
    """The real thing, minus the cluster: two 'nodes' of one process each on 127.0.0.1."""
    path = SCRIPTS / "launch_multinode.sh"
    env = {**os.environ, "NNODES": "2", "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(launch.free_port()), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    args = ["--max-steps", "3", "--batch-size", "16", "--metrics-out", str(tmp_path / "m.jsonl")]
    procs = [subprocess.Popen(["bash", str(path), *args], env={**env, "NODE_RANK": str(i)}, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert "world_size=2" in outs[0] and "done: step 3" in outs[0]
    assert '"world_size": 2' in (tmp_path / "m.jsonl").read_text()
