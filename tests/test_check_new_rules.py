"""ddp_lab.check rules DDP017-DDP020 and DDP105-DDP109: broken code they must flag (on the lines
marked `# <-`) and correct look-alikes they must leave alone. Pure AST: nothing here runs the code."""
import pytest

from ddp_lab import check
from test_check_rules import HEAD, _cases, lines, marked  # the same harness as the older rules

SPAWN = "import torch.multiprocessing as mp\n"
LAUNCHED = 'dist.init_process_group("gloo", timeout=T)\n'


BROKEN = {
    "DDP017": [
        'for x, y in loader:\n    loss = crit(model(x), y)\n    if not torch.isfinite(loss):  # <-\n        continue\n'
        '    loss.backward()\n    optimizer.step()',
        'for x, y in loader:\n    loss = crit(model(x), y)\n    if torch.isnan(loss).any() or torch.isinf(loss).any():  # <-\n'
        '        optimizer.zero_grad()\n        continue\n    scaler.scale(loss).backward()',
        'for batch in loader:\n    loss = model(batch)\n    if math.isnan(loss.item()):  # <-\n        break\n    loss.backward()',
        'def step(batch):\n    loss = model(batch)\n    bad = ~loss.isfinite()\n    if bad:  # <-\n        return None\n'
        '    loss.backward()\n    return loss',
    ],
    "DDP018": [
        'rank = dist.get_rank()\ntorch.cuda.set_device(rank)  # <-',
        'rank = int(os.environ["RANK"])\nmodel = DDP(model.to(f"cuda:{rank}"),  # <-\n'
        '            device_ids=[rank])  # <-',
        'model = model.cuda(dist.get_rank())  # <-',
        'class T:\n    def __init__(self):\n        self.rank = int(os.environ["RANK"])\n'
        '        self.device = torch.device("cuda", self.rank)  # <-',
        'global_rank = dist.get_rank()\ndef main():\n    model = DDP(net, device_ids=[global_rank],  # <-\n'
        '                output_device=global_rank)  # <-',
    ],
    "DDP019": [
        SPAWN + 'def setup(rank, world_size):\n    os.environ["MASTER_ADDR"] = "localhost"\n'
        '    os.environ["MASTER_PORT"] = "12355"  # <-\n    dist.init_process_group("gloo", rank=rank, world_size=world_size)\n'
        'mp.spawn(train, args=(2,), nprocs=2)',
        SPAWN + 'def worker(rank):\n    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:23456",  # <-\n'
        '                            rank=rank, world_size=2)\nmp.spawn(worker, nprocs=2)',
        'from torch.multiprocessing import spawn\nos.environ["MASTER_PORT"] = str(29500)  # <-\nspawn(worker, nprocs=4)',
    ],
    "DDP020": [
        LAUNCHED + 'model = torch.nn.DataParallel(model)  # <-',
        'local_rank = int(os.environ["LOCAL_RANK"])\nif torch.cuda.device_count() > 1:\n'
        '    model = nn.DataParallel(model)  # <-',
        '"""Run: torchrun --nproc_per_node=4 train.py"""\nfrom torch.nn import DataParallel\n'
        'model = DataParallel(model).cuda()  # <-',
    ],
}

LOOKALIKES = {
    "DDP017": [
        # the decision is all-reduced first: every rank skips together
        'for x, y in loader:\n    loss = crit(model(x), y)\n    bad = (~torch.isfinite(loss)).float()\n'
        '    dist.all_reduce(bad, op=dist.ReduceOp.MAX)\n    if bad.item():\n        continue\n    loss.backward()',
        # the loss itself was averaged across ranks: every rank sees the same number
        'for x, y in loader:\n    loss = crit(model(x), y)\n    dist.all_reduce(loss)\n'
        '    if not torch.isfinite(loss):\n        continue\n    loss.backward()',
        # after backward the gradients are all-reduced: the norm is the same on every rank
        'for x, y in loader:\n    crit(model(x), y).backward()\n'
        '    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n'
        '    if not torch.isfinite(norm):\n        optimizer.zero_grad()\n        continue\n    optimizer.step()',
        # GradScaler skips the step itself, on every rank alike
        'for x, y in loader:\n    loss = crit(model(x), y)\n    scaler.scale(loss).backward()\n'
        '    scaler.step(optimizer)\n    scaler.update()',
        # stop the whole job: raising ends every rank (torchrun tears the group down)
        'for x, y in loader:\n    loss = crit(model(x), y)\n    if not torch.isfinite(loss):\n'
        '        raise FloatingPointError("loss is not finite")\n    loss.backward()',
        # a learning rate from the schedule is the same number on every rank
        'for step, (x, y) in enumerate(loader):\n    lr = get_lr(step)\n    if math.isnan(lr):\n        break\n'
        '    crit(model(x), y).backward()',
        # evaluation: no backward follows, no collective to miss
        'for x, y in val_loader:\n    loss = crit(model(x), y)\n    if torch.isnan(loss):\n        continue\n    total += loss',
    ],
    "DDP018": [
        'local_rank = int(os.environ["LOCAL_RANK"])\ntorch.cuda.set_device(local_rank)\n'
        'model = DDP(model.to(f"cuda:{local_rank}"), device_ids=[local_rank])',
        # mp.spawn hands each process its index on this machine: rank is the local rank here
        'def demo(rank, world_size):\n    model = DDP(net.to(rank), device_ids=[rank])\n    torch.cuda.set_device(rank)',
        'rank = dist.get_rank()\ntorch.cuda.set_device(rank % torch.cuda.device_count())',
        'rank = dist.get_rank()\ndevice = torch.device("cuda", int(os.environ["LOCAL_RANK"]))\nprint(rank)',
        'rank = dist.get_rank()\nrank = rank % 8\ntorch.cuda.set_device(rank)',
        'torch.cuda.set_device(dist.get_node_local_rank())',
        'rank = dist.get_rank()\ndef worker(rank):\n    torch.cuda.set_device(rank)  # the parameter, not the global',
        'rank = int(os.environ.get("LOCAL_RANK", 0))  # a local rank, whatever its name\ntorch.cuda.set_device(rank)',
    ],
    "DDP019": [
        # a program started by torchrun: torchrun owns the port
        'os.environ.setdefault("MASTER_PORT", "29500")\ndist.init_process_group("gloo", timeout=T)',
        SPAWN + 'os.environ["MASTER_PORT"] = str(free_port())\nmp.spawn(worker, nprocs=2)',
        SPAWN + 'os.environ.setdefault("MASTER_PORT", "29500")  # a default the caller can override\n'
        'mp.spawn(worker, nprocs=2)',
        SPAWN + 'def worker(rank, port):\n    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", '
        'rank=rank, world_size=2)\nmp.spawn(worker, args=(find_free_port(),), nprocs=2)',
        'os.environ["MASTER_PORT"] = "29500"\ndist.init_process_group("gloo", init_method="env://", timeout=T)',
    ],
    "DDP020": [
        # one process driving every GPU: what DataParallel is for
        'model = torch.nn.DataParallel(model)\nout = model(x)',
        # the pytorch/examples imagenet pattern: DDP when distributed, DataParallel otherwise
        LAUNCHED + 'if args.distributed:\n    model = DDP(model, device_ids=[local_rank])\nelse:\n'
        '    model = torch.nn.DataParallel(model)',
        LAUNCHED + 'model = DDP(model) if dist.is_initialized() else torch.nn.DataParallel(model)',
        LAUNCHED + 'model = DDP(model, device_ids=[local_rank])\nprint(isinstance(model, torch.nn.DataParallel))',
        LAUNCHED + 'from torch.nn.parallel import DistributedDataParallel\nmodel = DistributedDataParallel(model)',
    ],
}

SHELL_BROKEN = {
    "DDP105": [
        "for lr in 0.1 0.01 0.001; do\n"
        "  torchrun --nproc_per_node=2 --master_port=29500 train.py --lr $lr &  # <-\ndone\nwait",
        "torchrun --nproc_per_node=2 --master_port 29500 train.py --seed 1 &\n"
        "torchrun --nproc_per_node=2 --master_port 29500 train.py --seed 2 &  # <-\nwait",
        "#SBATCH --array=0-9\n#SBATCH --gpus-per-node=2\n"
        "torchrun --nproc_per_node=2 --master_port=29500 train.py --fold $SLURM_ARRAY_TASK_ID  # <-",
        "MASTER_PORT=29500 python -m torch.distributed.run --nproc_per_node=2 a.py &\n"
        "MASTER_PORT=29500 torchrun --nproc_per_node=2 b.py  # <-",
        # the port through a variable, and the launch in a bash array (as scripts/slurm_ddp.sbatch writes it)
        '#SBATCH --array=0-3\nPORT="${PORT:-29500}"\ncmd=(\n  srun torchrun --nproc_per_node=4 --rdzv_backend=c10d\n'
        '  --rdzv_endpoint="$HEAD:$PORT" train.py  # <-\n)\nexec "${cmd[@]}"',
    ],
    "DDP106": [
        "#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --gres=gpu:4\n"
        "srun torchrun --nproc_per_node=8 train.py  # <-",
        "#SBATCH --gpus-per-node=a100:2\ntorchrun \\\n  --nnodes=1 \\\n  --nproc-per-node 4 \\  # <-\n  train.py",
        "#SBATCH -N 2\n#SBATCH --gpus=8\ntorchrun --nnodes=2 --nproc_per_node=8 train.py  # <-",
        "#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-task=2\ntorchrun --nproc_per_node=4 train.py  # <-",
    ],
    "DDP107": [
        "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=4  # <-\n#SBATCH --gpus-per-node=4\n"
        "srun torchrun --nnodes=2 --nproc_per_node=4 train.py",
        "#SBATCH --nodes=2\ncmd=(\n  srun --ntasks-per-node=2 python -m torch.distributed.run  # <-\n"
        "  --nproc_per_node=2 train.py\n)\nexec \"${cmd[@]}\"",
    ],
    "DDP108": [
        '#SBATCH --nodes=2\nHEAD_NODE="$SLURM_SUBMIT_HOST"\n'
        'srun torchrun --nnodes=2 --rdzv_backend=c10d --rdzv_endpoint="$HEAD_NODE:29500" train.py  # <-',
        "#SBATCH --nodes=2\nexport MASTER_ADDR=$SLURM_SUBMIT_HOST  # <-\nsrun python train.py",
    ],
    "DDP109": [
        "#SBATCH --nodes=2\n#SBATCH --cpus-per-task=16\nsrun torchrun --nnodes=2 --nproc_per_node=4 train.py  # <-",
        "#SBATCH -c 8\nsrun --ntasks-per-node=4 python train.py  # <-",
        "#SBATCH -c8\nsrun -N 2 --kill-on-bad-exit=1 \"$PYTHON\" -m torch.distributed.run train.py  # <-",
        # srun started through a bash array, as scripts/slurm_ddp.sbatch writes it
        '#SBATCH --cpus-per-task 16\ncmd=(\n  srun --kill-on-bad-exit=1  # <-\n  "$PY" -m torch.distributed.run train.py\n)\n'
        'exec "${cmd[@]}"',
        # set but not exported: srun does not see it
        "#SBATCH --cpus-per-task=8\nSRUN_CPUS_PER_TASK=8\nsrun torchrun train.py  # <-",
        "#SBATCH --cpus-per-task=8\nsrun --cpus-per-task=8 python prepare.py\nsrun torchrun train.py  # <-",
    ],
}

SHELL_LOOKALIKES = {
    "DDP105": [
        # the nodes of one job share the port on purpose
        "torchrun --nnodes=2 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 train.py &\n"
        "torchrun --nnodes=2 --node_rank=1 --master_addr=10.0.0.1 --master_port=29500 train.py &\nwait",
        # one after the other: the port is free again when the next one starts
        "torchrun --nproc_per_node=2 --master_port=29500 train.py --seed 1\n"
        "torchrun --nproc_per_node=2 --master_port=29500 train.py --seed 2",
        "for lr in 0.1 0.01; do\n  torchrun --standalone --nproc_per_node=2 train.py --lr $lr &\ndone\nwait",
        "i=0\nfor lr in 0.1 0.01; do\n  torchrun --nproc_per_node=2 --master_port=$((29500 + i)) train.py &\n"
        "  i=$((i + 1))\ndone\nwait",
        "for seed in 1 2; do\n  torchrun --nproc_per_node=2 --master_port=29500 train.py --seed $seed\ndone",
        "torchrun --nproc_per_node=2 --master_port=29500 train.py &\ntorchrun --nproc_per_node=2 --master_port=29501 eval.py",
        "torchrun --nproc_per_node=2 --master_port=29500 a.py &\nwait\ntorchrun --nproc_per_node=2 --master_port=29500 b.py",
        '#SBATCH --array=0-3\nPORT="${PORT:-$(( 29500 + ${SLURM_ARRAY_TASK_ID:-0} ))}"\n'
        'srun torchrun --rdzv_backend=c10d --rdzv_endpoint="$HEAD:$PORT" train.py',
        "port=29500\nfor lr in 0.1 0.01; do\n  torchrun --master_port=$port train.py &\n  port=$((port + 1))\ndone\nwait",
    ],
    "DDP106": [
        "#SBATCH --gres=gpu:4\nsrun torchrun --nproc_per_node=4 train.py",
        "#SBATCH --gpus-per-node=8\ntorchrun --nproc_per_node=$SLURM_GPUS_ON_NODE train.py",
        "#SBATCH --gpus-per-node=8\ntorchrun --nproc_per_node=gpu train.py",
        # fewer processes than GPUs: a process may drive several GPUs (a model split in two)
        "#SBATCH --gres=gpu:8\ntorchrun --nproc_per_node=4 train.py",
        # --gpus without --nodes: the file does not say how they are spread
        "#SBATCH --gpus=4\ntorchrun --nproc_per_node=8 train.py",
        "torchrun --nproc_per_node=8 train.py  # no #SBATCH line: the job's GPUs are not known here",
        "#SBATCH --ntasks=8\n#SBATCH --gpus-per-task=1\nsrun torchrun --nproc_per_node=2 train.py",
    ],
    "DDP108": [
        '#SBATCH --nodes=2\nHEAD_NODE="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"\n'
        'srun torchrun --nnodes=2 --rdzv_backend=c10d --rdzv_endpoint="$HEAD_NODE:29500" train.py',
        'echo "submitted from $SLURM_SUBMIT_HOST"\nsrun torchrun --nnodes=2 --rdzv_endpoint="$(hostname):29500" train.py',
    ],
    "DDP107": [
        "#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=4\nsrun torchrun --nproc_per_node=4 train.py",
        # srun starting the workers itself: a task per GPU is right
        "#SBATCH --ntasks-per-node=4\n#SBATCH --gpus-per-node=4\nsrun python train.py",
        # torchrun started once, by the batch script, not by srun
        "#SBATCH --ntasks-per-node=4\ntorchrun --nproc_per_node=4 train.py",
    ],
    "DDP109": [
        "#SBATCH --cpus-per-task=16\nsrun --cpus-per-task=$SLURM_CPUS_PER_TASK torchrun --nproc_per_node=4 train.py",
        "#SBATCH -c 8\nsrun -c 8 python train.py",
        "#SBATCH -c 8\nsrun -c8 python train.py",
        "#SBATCH --cpus-per-task=8\nexport SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK\nsrun torchrun train.py",
        "#SBATCH --cpus-per-task=8\nSRUN_CPUS_PER_TASK=8\nexport SRUN_CPUS_PER_TASK\nsrun torchrun train.py",
        "#SBATCH --cpus-per-task=8\nSRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK srun torchrun train.py",
        "#SBATCH --cpus-per-task=1\nsrun torchrun train.py",
        "#SBATCH --nodes=2\nsrun torchrun --nnodes=2 train.py",
        "srun torchrun train.py  # no #SBATCH line: an interactive allocation's step",
        # srun starting something other than training; torchrun started without srun
        "#SBATCH --cpus-per-task=8\nsrun hostname\necho srun python\ntorchrun --nproc_per_node=4 train.py",
    ],
}


@pytest.mark.parametrize("rule, code", _cases(BROKEN))
def test_python_rule_flags_broken_code(rule, code):
    assert lines(HEAD + code, rule) == [n + 4 for n in marked(code)]


@pytest.mark.parametrize("rule, code", _cases(LOOKALIKES))
def test_python_rule_leaves_correct_lookalikes_alone(rule, code):
    assert lines(HEAD + code, rule) == []


@pytest.mark.parametrize("rule, code", _cases(SHELL_BROKEN))
def test_shell_rule_flags_broken_commands(rule, code):
    assert lines(code, rule, "shell") == marked(code)


@pytest.mark.parametrize("rule, code", _cases(SHELL_LOOKALIKES))
def test_shell_rule_leaves_correct_commands_alone(rule, code):
    assert lines(code, rule, "shell") == []


def test_every_new_rule_has_broken_examples_and_lookalikes():
    new = {r for r in check.RULES if r >= "DDP017" and not "DDP021" <= r < "DDP105"}  # DDP021-: test_check_new_classes
    assert new == set(BROKEN) | set(SHELL_BROKEN)
    assert all(BROKEN.get(r) and LOOKALIKES.get(r) or SHELL_BROKEN.get(r) and SHELL_LOOKALIKES.get(r) for r in new)


def test_nonfinite_skip_is_quiet_without_ddp_and_in_a_notebook_kernel():
    code = 'for x, y in loader:\n    loss = crit(model(x), y)\n    if not torch.isfinite(loss):\n        continue\n    loss.backward()'
    assert lines("import torch\n" + code, "DDP017") == []            # one process: nothing to desync
    assert [f.id for f in check.source(HEAD + code, "cell")] == []   # the kernel is one process


def test_messages_name_the_port_and_the_counts():
    found = check.source("#SBATCH --gres=gpu:4\ntorchrun --nproc_per_node=8 train.py", "shell")
    assert [f.message for f in found] == ["--nproc_per_node=8 starts 8 processes per node, but the job asks for 4 "
                                          "GPUs per node: processes share a GPU or pick one that does not exist."]
    found = check.source(SHELL_BROKEN["DDP105"][1], "shell")
    assert "Port 29500" in found[0].message and "line 1" in found[0].message


def test_messages_say_what_a_real_slurm_showed():
    """Measured in notebook 10 on a real SLURM: with the c10d rendezvous, a fixed port in a job array
    does not fail at once; the second torchrun joins the first one's store. Two torchruns a node
    (--ntasks-per-node=2) never form one world."""
    found = check.source(SHELL_BROKEN["DDP105"][4], "shell")
    assert [f.id for f in found] == ["DDP105"]
    assert "joins the first one's rendezvous store" in found[0].message and "RendezvousConnectionError" in found[0].message
    found = check.source(SHELL_BROKEN["DDP107"][0], "shell")
    assert [f.message for f in found] == [
        "--ntasks-per-node=4: srun starts 4 torchruns on every node, 4 x 4 = 16 processes a node, not one world: "
        "the torchruns of a node share the rendezvous port, only one per node joins, and the others fail when it ends."]
    assert check.source(open("scripts/slurm_ddp.sbatch").read(), "shell") == []


def test_srun_without_cpus_names_the_count_and_the_fix():
    """Measured in notebook 10 on a real SLURM 22.05 that binds tasks to CPUs: without srun's own
    --cpus-per-task each worker ran on 1 CPU of the task's 2. The shipped batch file passes it."""
    found = check.source(SHELL_BROKEN["DDP109"][0], "shell")
    assert [f.id for f in found] == ["DDP109"] and found[0].col == 1
    assert "--cpus-per-task=16" in found[0].message and "22.05-23.02" in found[0].message
    assert "srun --cpus-per-task=$SLURM_CPUS_PER_TASK" in found[0].message
    shipped = open("scripts/slurm_ddp.sbatch").read()
    flag = ' --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}"'   # what notebook 10's probe job removes
    assert flag in shipped and check.source(shipped, "shell") == []
    assert [f.id for f in check.source(shipped.replace(flag, ""), "shell")] == ["DDP109"]
