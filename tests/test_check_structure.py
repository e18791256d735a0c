"""ddp_lab.check recognises shapes by their structure, not their names: accumulation windows,
model wrappers and their aliases, global ranks computed from node and local indices, launch lines
with redirections; plus the DDP006/DDP009 messages, nbformat 3 notebooks and runs that check no
file. Broken code is flagged on the lines marked `# <-`; the look-alikes stay quiet."""
import json

import pytest

from ddp_lab import check, cli
from test_check_rules import HEAD, _cases, lines, marked

BROKEN = {
    # 1. an accumulation window, whatever the loop and the optimizer are called
    "DDP010": [
        'model = DDP(net)\nfor sample in samples:\n    loss = model(sample).sum()\n    loss.backward()  # <-\nopt.step()',
        'model = DDP(net)\nsolver = torch.optim.SGD(model.parameters(), lr=0.1)\nfor chunk in chunks:\n'
        '    model(chunk).sum().backward()  # <-\nsolver.step()',
        'model = DDP(net)\nfor x in loader:\n    model(x).sum().backward()  # <-\n    seen += 1\n'
        '    if seen == k:\n        optimizer.step()\n        seen = 0',
        'model = DDP(net)\nwhile pending:\n    model(pending.pop()).sum().backward()  # <-\ntrainer_opt.step()',
    ],
    # 2. wrappers rebind the model name; the model is followed through them
    "DDP004": [
        'model = DDP(model)\nmodel = torch.compile(model)\nmodel.to(device)  # <-\nout = model(x)',
        'raw = Net()\nmodel = torch.compile(raw)\nmodel = DDP(model)\nraw.cuda()  # <-\nout = model(x)',
        'def wrap(m):\n    return DDP(m, device_ids=[0])\n\nmodel = wrap(model)\n'
        'model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)  # <-\nmodel.train()',
        'def build(args):\n    net = Net()\n    ddp = DDP(net)\n    return ddp\n\nmodel = build(args)\n'
        'model.cuda()  # <-\nmodel(x)',
        'class T:\n    def __init__(self, m):\n        self.model = DDP(m)\n        self.model = torch.compile(self.model)\n'
        '        self.model.to(dev)  # <-\n        self.model(x)',
        'ddp_model = DDP(model)\nnet = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)  # <-\nddp_model(x)',
    ],
    "DDP015": [
        'def wrap(m):\n    return DDP(m, device_ids=[0])\n\nmodel = wrap(model)\nif rank == 0:\n'
        '    torch.save(model.state_dict(), "m.pt")  # <-',
    ],
    # 3. a global rank computed from the node's first rank, or read from the launcher's variables
    "DDP018": [
        'def main_worker(gpu, ngpus_per_node, args):\n    args.rank = args.rank * ngpus_per_node + gpu\n'
        '    torch.cuda.set_device(args.rank)  # <-',
        'def main_worker(gpu, args):\n    rank = args.nr * args.gpus + gpu\n    model.cuda(rank)  # <-',
        'rank = int(os.environ["SLURM_PROCID"])\ntorch.cuda.set_device(rank)  # <-',
        'proc = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0))\nmodel = DDP(net, device_ids=[proc])  # <-',
    ],
    "DDP009": [
        'gid = node_id * torch.cuda.device_count() + i\nif gid == 0:\n    dist.barrier()  # <-',
    ],
    # 6. one finding per seed; a random split is reached too
    "DDP006": [
        'def train(rank):\n    random.seed(42 + rank)  # <-\n    np.random.seed(42 + rank)\n'
        '    torch.manual_seed(42 + rank)\n    model = DDP(Net())',
        'def train(rank):\n    torch.manual_seed(42 + rank)  # <-\n'
        '    train_ds, val_ds = torch.utils.data.random_split(ds, [0.9, 0.1])',
        'def train(rank):\n    model = DDP(Net())\n    torch.manual_seed(42 + rank)  # <-\n    teacher_model = Net()',
        'def train(rank):\n    model_cfg = load_cfg()\n    torch.manual_seed(42 + rank)  # <-\n    model = Net(model_cfg)',
    ],
}

LOOKALIKES = {
    "DDP010": [
        'model = DDP(net)\nfor sample in samples:\n    model(sample).sum().backward()\n    opt.step()',
        'model = DDP(net)\nfor x in loader:\n    model(x).sum().backward()\n    if use_amp:\n'
        '        scaler.step(optimizer)\n    else:\n        optimizer.step()',
        'model = DDP(net)\nfor i, x in enumerate(loader):\n    model(x).sum().backward()\n    if i >= warmup:\n'
        '        optimizer.step()',
        'model = DDP(net)\nfor i, s in enumerate(samples):\n    with model.no_sync() if i < n - 1 else nullcontext():\n'
        '        model(s).sum().backward()\nopt.step()',
        'model = DDP(net)\nfor x in loader:\n    model(x).sum().backward()\nscheduler.step()',
    ],
    "DDP004": [
        'model = torch.compile(model)\nmodel = model.to(device)\nmodel = DDP(model)\nmodel(x)',
        'def wrap(m):\n    m = m.to(dev)\n    return DDP(m)\n\nmodel = build()\nmodel = wrap(model)\nmodel(x)',
        'raw = Net()\nmodel = DDP(raw.to(dev))\nmodel(x)\nraw = Net()\nraw.cuda()',
        'def build(args):\n    return Net()\n\nmodel = build(args)\nmodel.cuda()\nmodel = DDP(model)\nmodel(x)',
        # a second wrapper built from the same model: the move belongs to the new wrap
        'net = DDP(model.cuda(rank), device_ids=[rank])\nnet(x)\nnet = DDP(model.cuda(rank), device_ids=[rank])\nnet(x)',
    ],
    "DDP015": [
        'def wrap(m):\n    return m.to(0)\n\nmodel = wrap(model)\nif rank == 0:\n    torch.save(model.state_dict(), "m.pt")',
    ],
    "DDP018": [
        'def main_worker(gpu, ngpus_per_node, args):\n    args.rank = args.rank * ngpus_per_node + gpu\n'
        '    torch.cuda.set_device(gpu)\n    model.cuda(gpu)',
        'local = int(os.environ["SLURM_LOCALID"])\ntorch.cuda.set_device(local)',
        'lr = base_lr * ngpus_per_node + 1\ntorch.cuda.set_device(lr)',
        'rank = 100 * trial + 7\ntorch.cuda.set_device(rank)',
    ],
    "DDP009": [
        'gid = node_id * torch.cuda.device_count() + i\ndist.barrier()\nif gid == 0:\n    print("ready")',
    ],
    "DDP006": [
        # the model is built and wrapped: a per-rank seed now only varies augmentation
        'def train(rank):\n    model = DDP(Net().cuda())\n    torch.manual_seed(42 + rank)\n    aug_net = AugNet()',
        'def train(rank):\n    model = DDP(Net())\n    torch.manual_seed(42 + rank)\n    model_ema = ModelEma(model)',
        'def train(rank):\n    model = Net()\n    model = DDP(model)\n    torch.manual_seed(42 + rank)\n'
        '    ema_model = torch.optim.swa_utils.AveragedModel(model)',
        'model = DDP(Net())\ntorch.manual_seed(42 + rank)\nmain()\n\ndef main():\n    model = Net()',
        'def train(rank):\n    torch.manual_seed(42 + rank)\n'
        '    a, b = random_split(ds, [0.9, 0.1], generator=torch.Generator().manual_seed(0))',
    ],
}

SHELL_BROKEN = {
    "DDP106": ["#SBATCH --gres=gpu:4\ntorchrun --nproc_per_node 8 train.py > log 2>&1 &  # <-"],
    # 4. a launch sent to the background with its output redirected
    "DDP105": [
        "torchrun --nproc_per_node=2 --master_port=29500 a.py > a.log 2>&1 &\n"
        "torchrun --nproc_per_node=2 --master_port=29500 b.py > b.log 2>&1 &  # <-\nwait",
        "for lr in 0.1 0.01; do\n"
        "  nohup torchrun --master_port=29500 train.py --lr $lr &> run_$lr.log &  # <-\ndone\nwait",
        "torchrun --master_port=29500 a.py 2>&1 | tee a.log &\ntorchrun --master_port=29500 b.py  # <-",
    ],
}

SHELL_LOOKALIKES = {
    "DDP106": [
        # a count before `>` is an argument, not a file descriptor
        "#SBATCH --gres=gpu:4\ntorchrun --nproc_per_node 4 train.py --epochs 2 > log 2>&1",
    ],
    "DDP105": [
        "torchrun --master_port=29500 a.py > a.log 2>&1\ntorchrun --master_port=29500 b.py > b.log 2>&1",
        "torchrun --master_port=29500 a.py 2>&1 | tee a.log\ntorchrun --master_port=29500 b.py",
        "torchrun --master_port=29500 a.py > a.log 2>&1 &\nwait\ntorchrun --master_port=29500 b.py > b.log 2>&1 &",
    ],
}


@pytest.mark.parametrize("rule, code", _cases(BROKEN))
def test_structure_is_recognised_whatever_the_names(rule, code):
    assert lines(HEAD + code, rule) == [n + 4 for n in marked(code)]


@pytest.mark.parametrize("rule, code", _cases(LOOKALIKES))
def test_structural_lookalikes_stay_quiet(rule, code):
    assert lines(HEAD + code, rule) == []


@pytest.mark.parametrize("rule, code", _cases(SHELL_BROKEN))
def test_launch_with_redirections_is_a_launch(rule, code):
    assert lines(code, rule, "shell") == marked(code)


@pytest.mark.parametrize("rule, code", _cases(SHELL_LOOKALIKES))
def test_launch_with_redirections_lookalikes_stay_quiet(rule, code):
    assert lines(code, rule, "shell") == []


@pytest.mark.parametrize("line", ["torchrun --nproc_per_node=2 train.py &",
                                  "torchrun --nproc_per_node=2 train.py > log 2>&1 &",
                                  "torchrun --nproc_per_node=2 train.py &> log &",
                                  "torchrun --nproc_per_node=2 train.py >> log 2> err < /dev/null &",
                                  "torchrun --nproc_per_node 2 train.py 1>log 2>&1 &"])
def test_redirections_are_not_arguments_and_keep_the_background(line):
    from ddp_lab.check import shell
    [cmd] = shell.scan(line).commands
    assert cmd.background and shell.option(cmd, 1, "--nproc_per_node") == "2" and cmd.tokens[-1] == "train.py"


def test_ddp009_names_the_collective_and_its_condition():
    [f] = check.source(HEAD + "if rank == 0:\n    dist.barrier()", select=["DDP009"])
    assert f.message.startswith("dist.barrier() is a collective, but it runs only under `if rank == 0:` (line 5)")
    code = HEAD + "def f():\n    if dist.get_rank() != 0:\n        return\n    dist.all_reduce(t)\n\nf()"
    [f] = check.source(code, select=["DDP009"])
    assert "dist.all_reduce()" in f.message and "after `if dist.get_rank() != 0: return` (line 6)" in f.message
    code = HEAD + "if not is_main:\n    pass\nelse:\n    dist.broadcast(t, src=0)"
    [f] = check.source(code, select=["DDP009"])
    assert "dist.broadcast()" in f.message and "in the else of `if not is_main:` (line 5)" in f.message


def test_ddp006_reports_a_seed_once_and_names_its_other_calls_and_the_build():
    [f] = check.source(HEAD + BROKEN["DDP006"][0], select=["DDP006"])
    assert f.message.startswith("A per-rank seed (42 + rank; also set on lines 7, 8) before the model is "
                                "built (line 9): the ranks build different initial weights.")
    two_seeds = HEAD + "torch.manual_seed(s + rank)\nnp.random.seed(s + 2 * rank)\nmodel = Net()"
    assert len(check.source(two_seeds, select=["DDP006"])) == 2


V3 = json.dumps({"nbformat": 3, "nbformat_minor": 0, "metadata": {},
                 "worksheets": [{"cells": [{"cell_type": "code", "input": "import torch"}]}]})


def test_nbformat_3_notebook_gets_one_line_naming_the_upgrade(tmp_path, capsys):
    path = tmp_path / "old.ipynb"
    path.write_text(V3)
    with pytest.raises(check.Unreadable, match=r"^nbformat 3 notebook: upgrade it with "
                                               r"`jupyter nbconvert --to notebook --nbformat 4`$"):
        check.check_file(path)
    assert cli.main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "nbformat 3 notebook" in err and "'cells'" not in err


def test_json_that_is_no_notebook_says_so(tmp_path):
    path = tmp_path / "list.ipynb"
    path.write_text("[1, 2]")
    with pytest.raises(check.Unreadable, match="not a notebook"):
        check.check_file(path)


def test_no_file_checked_is_an_error_not_a_clean_run(tmp_path, capsys):
    (tmp_path / "notes.md").write_text("# nothing to check")
    assert cli.main(["check", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "no DDP problems found" not in err
    assert err.strip().count("\n") == 0 and "no file was checked" in err and "holds no .py" in err


def test_every_path_failing_is_an_error_with_one_reason(tmp_path, capsys):
    assert cli.main(["check", str(tmp_path / "missing.py"), str(tmp_path / "gone.py")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "no DDP problems found" not in out + err
    assert err.splitlines()[-1] == ("ddp-lab check: no file was checked: all 2 paths could not be read or "
                                    "parsed (see above)")


def test_a_clean_file_still_reports_no_problems(tmp_path, capsys):
    (tmp_path / "ok.py").write_text("import torch\n")
    assert cli.main(["check", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "no DDP problems found (1 file checked)\n"
