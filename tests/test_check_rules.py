"""ddp_lab.check, rule by rule: broken code it must flag (on the lines marked `# <-`), and correct
look-alikes it must leave alone. Pure AST: nothing here runs the code."""
import json
import textwrap

import pytest

from ddp_lab import check

HEAD = "import os\nimport torch\nimport torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"


def lines(code: str, rule: str, kind: str = "python") -> list[int]:
    return [f.line for f in check.source(code, kind) if f.id == rule]


def marked(code: str) -> list[int]:
    return [i for i, line in enumerate(code.splitlines(), 1) if "# <-" in line]


def notebook(*cells: str) -> str:
    return json.dumps({"cells": [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                                  "source": c} for c in cells], "metadata": {}, "nbformat": 4, "nbformat_minor": 5})


BROKEN = {
    "DDP001": [
        'dist.init_process_group("nccl", timeout=T)  # <-',
        'dist.init_process_group(backend="NCCL", init_method="env://", timeout=T)  # <-',
    ],
    "DDP002": [
        'dist.init_process_group("gloo")  # <-',
        'dist.init_process_group(  # <-\n    backend=b,\n    init_method="env://")',
    ],
    "DDP003": [
        'local_rank = int(os.environ["LOCAL_RANK"])\nif local_rank == 0:  # <-\n    torch.save(m.module.state_dict(), "m.pt")',
        'if args.local_rank in [-1, 0]:  # <-\n    print("loss", 1)',
        'gpu = int(os.environ["LOCAL_RANK"])\nif step % 10 == 0 and gpu == 0:  # <-\n    save_checkpoint(m)',
        'class T:\n    def __init__(self):\n        self.gpu_id = int(os.environ["LOCAL_RANK"])\n'
        '    def train(self):\n        if self.gpu_id == 0:  # <-\n            self._save_snapshot()',
        's = DistributedSampler(ds, rank=local_rank)  # <-',
        's = DistributedSampler(ds, num_replicas=torch.cuda.device_count(), rank=rank)  # <-',
    ],
    "DDP004": [
        'model = DDP(model)\nmodel.to(device)  # <-\nout = model(x)',
        'ddp = DDP(net, device_ids=[0])\nnet.cuda()  # <-\nddp(x).sum().backward()',
        'model = DDP(model).to(device)  # <-',
        'model = DDP(model)\nmodel = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)  # <-\nmodel.train()',
    ],
    "DDP005": [
        'from torchvision import models\nm = models.resnet18()\nm = DDP(m, broadcast_buffers=False)  # <-',
        'net = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3), torch.nn.BatchNorm2d(8))\n'
        'm = DDP(\n    net,\n    broadcast_buffers=False,  # <-\n)',
    ],
    "DDP006": [
        'def train(rank):\n    seed_everything(42 + rank)  # <-\n    model = build_model()\n    model = DDP(model)',
        'torch.manual_seed(args.seed + dist.get_rank())  # <-\nnet = Net().to(device)',
        # a function of the file that builds and wraps, handed no model: a build
        'def setup_model(args):\n    return DDP(Net())\n\ndef train(args, rank):\n'
        '    torch.manual_seed(args.seed + rank)  # <-\n    model = setup_model(args)',
    ],
    "DDP007": [
        'sampler = DistributedSampler(ds)\nloader = DataLoader(ds, sampler=sampler)\n'
        'for epoch in range(10):  # <-\n    for x in loader:\n        step(x)',
        'loader = DataLoader(ds, sampler=DistributedSampler(ds, shuffle=True))\n'
        'epoch = 0\nwhile epoch < n_epochs:  # <-\n    for x in loader:\n        step(x)\n    epoch += 1',
    ],
    "DDP008": [
        'for x, y in loader:\n    loss = crit(model(x), y)\n    if dist.get_rank() == 0:\n'
        '        print(f"loss {loss.item():.3f}")  # <-',
        'running_loss = 0.0\nfor x, y in loader:\n    running_loss += crit(model(x), y).item()\n'
        'if rank == 0:\n    logger.info("epoch loss %.3f", running_loss / len(loader))  # <-',
        'for x, y in loader:\n    loss = crit(model(x), y)\n    if is_main:\n'
        '        lossf = loss.item() * accum\n        print(lossf)  # <-',
        'loss_meter = AverageMeter()\nfor x, y in loader:\n    loss_meter.update(crit(model(x), y).item())\n'
        'if rank == 0:\n    print(loss_meter.avg)  # <-',
    ],
    "DDP009": [
        'if rank == 0:\n    dist.barrier()  # <-',
        'if dist.get_rank() == 0:\n    dist.all_reduce(t)  # <-\n    print(t)',
        'if not is_main:\n    pass\nelse:\n    dist.broadcast(t, src=0)  # <-',
    ],
    "DDP010": [
        'for step, (x, y) in enumerate(loader):\n    loss = crit(model(x), y) / K\n'
        '    scaler.scale(loss).backward()  # <-\n    if (step + 1) % K == 0:\n'
        '        scaler.step(optimizer)\n        scaler.update()\n        optimizer.zero_grad()',
        'for i, (x, y) in enumerate(loader):\n    crit(model(x), y).backward()  # <-\n'
        '    if i % K != 0:\n        continue\n    optimizer.step()\n    optimizer.zero_grad()',
        'for it in range(steps):\n    for micro_step in range(accum_steps):\n'
        '        (model(next(data)).mean() / accum_steps).backward()  # <-\n    optimizer.step()',
        'class Acc:\n    def step(self, loss):\n        loss.backward()  # <-\n        self.n += 1\n'
        '        if self.n % self.k == 0:\n            self.opt.step()',
    ],
    "DDP011": [
        'loss = crit(model(x), y)\nwith model.no_sync():  # <-\n    loss.backward()',
        'out = ddp(x)\nwith (ddp.no_sync() if not last else contextlib.nullcontext()):  # <-\n'
        '    scaler.scale(out.sum() / k).backward()',
    ],
    "DDP012": [
        'scaler = torch.cuda.amp.GradScaler()  # <-\nwith torch.cuda.amp.autocast():  # <-\n    y = m(x)',
        'from torch.cuda.amp import GradScaler, autocast  # <-',
        'from torch.cuda import amp  # <-',
        'import torch.cuda.amp  # <-',
        'with torch.cpu.amp.autocast(dtype=torch.bfloat16):  # <-\n    y = m(x)',
    ],
    "DDP013": [
        'def main():\n    model = DDP(Net())\n    torch.save(model.module.state_dict(), "m.pt")  # <-\n\nmain()',
        'def save(m, path):\n    torch.save(m.module.state_dict(), path)\n\n'   # a helper: its call site
        'def train():\n    dist.init_process_group("gloo", timeout=T)\n    for epoch in range(3):\n'
        '        save(model, "last.pt")  # <-\n\nif __name__ == "__main__":\n    train()',
        'model = DDP(net)\ntorch.save(model.module.state_dict(), "final.pt")  # <-',
    ],
    "DDP014": [
        'local_rank = int(os.environ["LOCAL_RANK"])\ntorch.cuda.set_device(local_rank)\nstate = torch.load("ckpt.pt")  # <-',
        'model = DDP(m, device_ids=[local_rank])\nm.load_state_dict(torch.load(path, weights_only=True))  # <-',
    ],
    "DDP015": [
        'model = DDP(model, device_ids=[rank])\nif rank == 0:\n    torch.save(model.state_dict(), "m.pt")  # <-',
        'model = DDP(model)\nckpt = {"model": model.state_dict(), "step": 1}  # <-\nif rank == 0:\n'
        '    torch.save(ckpt, "m.pt")',
        'class T:\n    def __init__(self, m):\n        self.model = DDP(m)\n    def save(self):\n'
        '        if self.rank == 0:\n            torch.save(self.model.state_dict(), "m.pt")  # <-',
        'model = torch.compile(DDP(model))\nif rank == 0:\n    torch.save({"m": model.state_dict()}, "m.pt")  # <-',
    ],
    "DDP016": [
        'if local_rank == 0:  # <-\n    ckpt = torch.load(p, map_location=ml)\nelse:\n'
        '    ckpt = torch.load(p, map_location=ml)',
        'if dist.get_rank() == 0:  # <-\n    data = prepare()\nelse:\n    data = prepare()',
    ],
}

LOOKALIKES = {
    "DDP001": [
        'backend = "nccl" if torch.cuda.is_available() else "gloo"\ndist.init_process_group(backend, timeout=T)',
        'dist.init_process_group(backend="cuda:nccl,cpu:gloo", timeout=T)',
        'dist.new_group(ranks=[0, 1], backend="nccl")',
    ],
    "DDP002": [
        'dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))',
        'dist.init_process_group(**settings)',
        'g = dist.new_group([0, 1])',
    ],
    "DDP003": [
        'local_rank = int(os.environ["LOCAL_RANK"])\ntorch.cuda.set_device(local_rank)',
        'if local_rank == 0:\n    download_dataset("data/")  # node-local disk: once per node is right',
        'if local_rank != 0:\n    dist.barrier()',
        'if int(os.environ["RANK"]) == 0:\n    torch.save(m.module.state_dict(), "m.pt")',
        'sampler = DistributedSampler(ds, num_replicas=dist.get_world_size(), rank=dist.get_rank())',
        'if node_rank == 0:\n    print("head node")',
    ],
    "DDP004": [
        'model = model.to(device)\nmodel = DDP(model, device_ids=[0])\nx = x.to(device)\nout = model(x)',
        'ddp = DDP(net)\ntrain(ddp)\nnet.to("cpu")\ntorch.save(net.state_dict(), "m.pt")',
        'for name in names:\n    model = DDP(make(name).to(device))\n    run(model)',
        'model = DDP(model)\nmodel.module.to("cpu")',
        'net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net)\nmodel = DDP(net.to(device))\nmodel(x)',
    ],
    "DDP005": [
        'm = DDP(torch.nn.Linear(4, 4), broadcast_buffers=False)',
        'net = torch.nn.BatchNorm1d(4)\nnet = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net)\n'
        'm = DDP(net, broadcast_buffers=False)',
        'net = torch.nn.BatchNorm1d(4)\nm = DDP(net, broadcast_buffers=mode != "no_broadcast")',
        'net = torch.nn.BatchNorm1d(4)\nm = DDP(net)',
    ],
    "DDP006": [
        'torch.manual_seed(seed)\nmodel = build_model()\ntorch.manual_seed(seed + rank)\nmodel = DDP(model)',
        'g = torch.Generator().manual_seed(seed + rank)\nmodel = build_model()',
        'torch.manual_seed(seed + rank)\nloader = make_loader()',
        'torch.manual_seed(seed + rank)\ntorch.manual_seed(seed)\nmodel = Net()',
        'random.seed(seed + rank)\nmodel = model.to(device)\nmodel = DDP(model)',
        # the model built before the per-rank seed, wrapped after it by the file's own function
        'def wrap_model(args, model):\n    return DDP(model, bucket_cap_mb=args.cap)\n\ndef train(args, rank):\n'
        '    torch.manual_seed(args.seed)\n    raw_model = build_model()\n    torch.manual_seed(args.seed + rank)\n'
        '    model = wrap_model(args, raw_model)',
    ],
    "DDP007": [
        'sampler = DistributedSampler(ds, shuffle=False)\nfor epoch in range(3):\n    for x in DataLoader(ds, sampler=sampler):\n        f(x)',
        'sampler = DistributedSampler(ds)\nloader = DataLoader(ds, sampler=sampler)\nfor epoch in range(3):\n'
        '    loader.sampler.set_epoch(epoch)\n    for x in loader:\n        f(x)',
        'sampler = DistributedSampler(ds)\nfor x in DataLoader(ds, sampler=sampler):\n    evaluate(x)',
        'sampler = DistributedSampler(ds, shuffle=cfg.shuffle)\nfor epoch in range(3):\n    for x in loader:\n        f(x)',
    ],
    "DDP008": [
        'total = torch.zeros(2)\nfor x, y in loader:\n    loss = crit(model(x), y)\n    total += torch.stack([loss, one])\n'
        'dist.all_reduce(total)\nepoch_loss = total[0] / total[1]\nif rank == 0:\n    print(f"loss {epoch_loss:.3f}")',
        'for x, y in loader:\n    loss = crit(model(x), y)\n    mean_loss = reduce_mean(loss)\n'
        '    if rank == 0:\n        print(mean_loss.item())',
        'for x, y in loader:\n    loss = crit(model(x), y)\n    if rank == 0:\n        print(f"rank 0 loss {loss.item()}")',
        'if rank == 0:\n    acc = evaluate(model.module, full_val_loader)\n    print(f"val accuracy {acc:.3f}")',
        'def log(loss):\n    if rank == 0:\n        print(loss)',
        'loss_meter = AverageMeter()\nfor x, y in loader:\n    loss_meter.update(crit(model(x), y).item())\n'
        'loss_meter.all_reduce()\nif rank == 0:\n    print(loss_meter.avg)',
        'def run_epoch(loader):\n    total = torch.zeros(2)\n    for x, y in loader:\n        total += step(x, y)\n'
        '    dist.all_reduce(total)\n    return total[0] / total[1]\n\nfor epoch in range(3):\n'
        '    loss = run_epoch(loader)\n    val_acc = evaluate(model, val_loader)\n    if rank == 0:\n'
        '        print(f"loss {loss:.3f} accuracy {val_acc:.3f}")',
        'for x, y in loader:\n    loss = crit(model(x), y)\n    print(f"loss {loss.item()}")',
        'for x, y in loader:\n    loss = crit(model(x), y)\n    avg = accelerator.gather(loss).mean()\n'
        '    if accelerator.is_main_process:\n        print(avg, "loss")',
    ],
    "DDP009": [
        'if local_rank not in [-1, 0]:\n    dist.barrier()\nprepare()\nif local_rank == 0:\n    dist.barrier()',
        'if rank == 0:\n    dist.send(t, dst=1)\nelse:\n    dist.recv(t, src=0)',
        'if rank == 0:\n    dist.all_reduce(t, group=leaders)',
        'if rank == 0:\n    dist.barrier(group_id)',
        'dist.all_reduce(t)\nif rank == 0:\n    print(t)',
        'from functools import reduce\nif rank == 0:\n    total = reduce(lambda a, b: a + b, xs)',
        'if rank == 0:\n    ctx.record(kind="bw", time_s=times.median().item())',
    ],
    "DDP010": [
        'for step, (x, y) in enumerate(loader):\n    last = (step + 1) % K == 0\n'
        '    with contextlib.nullcontext() if last else model.no_sync():\n        crit(model(x), y).backward()\n'
        '    if last:\n        optimizer.step()',
        'for micro_step in range(K):\n    model.require_backward_grad_sync = micro_step == K - 1\n'
        '    model(x).sum().backward()\noptimizer.step()',
        'for step, (x, y) in enumerate(loader):\n    with accelerator.accumulate(model):\n'
        '        accelerator.backward(crit(model(x), y))\n        optimizer.step()',
        'for i, (x, y) in enumerate(loader):\n    loss = crit(model(x), y)\n    loss.backward()\n    optimizer.step()\n'
        '    if i % 100 == 0:\n        print(i)',
        'for i, (real, z) in enumerate(loader):\n    d_loss(real, z).backward()\n    d_opt.step()\n'
        '    if i % n_critic == 0:\n        g_loss(z).backward()\n        g_opt.step()',
        'for micro in range(accum):\n    model(x).sum().backward()\n    optimizer.step()',
    ],
    "DDP011": [
        'with model.no_sync():\n    loss = crit(model(x), y)\n    loss.backward()',
        'with (model.no_sync() if not last else contextlib.nullcontext()):\n    F.cross_entropy(model(x), y).backward()',
        'with model.no_sync():\n    loss = crit(model(x), y)\nloss.backward()',
        'model = torch.compile(ddp_model) if compile else ddp_model\n'
        'with contextlib.nullcontext() if sync else ddp_model.no_sync():\n'
        '    with autocast():\n        loss = F.cross_entropy(model(x), y)\n    scaler.scale(loss).backward()',
    ],
    "DDP012": [
        'scaler = torch.amp.GradScaler("cuda")\nwith torch.amp.autocast("cuda", dtype=torch.float16):\n    y = m(x)',
        'with torch.autocast(device_type="cuda", dtype=torch.bfloat16):\n    y = m(x)',
        'ok = torch.cuda.is_available()\nnote = "torch.cuda.amp is deprecated"',
        'from torch.amp import GradScaler, autocast',
        'KNOWN_AUTOCASTS = (torch.amp.autocast, torch.cuda.amp.autocast)  # names, not uses',
    ],
    "DDP013": [
        'if rank == 0:\n    torch.save(model.module.state_dict(), "m.pt")\ndist.barrier()',
        'def save(m):\n    if dist.get_rank() != 0:\n        return\n    torch.save(m.module.state_dict(), "m.pt")\n\nsave(model)',
        'def save(m):\n    torch.save(m.module.state_dict(), "m.pt")\n\nif is_main:\n    save(model)',
        'torch.save(torch.get_rng_state(), f"rng_rank{rank}.pt")',
        'path = f"shard_{dist.get_rank()}.pt"\ntorch.save(shard, path)',
        'buf = io.BytesIO()\ntorch.save(model.module.state_dict(), buf)',
        'def save_checkpoint(m, path):\n    torch.save(m.module.state_dict(), path)',
        'if world_size == 1 or rank == 0:\n    torch.save(state, "m.pt")',
        '@rank_zero_only\ndef save(m):\n    torch.save(m.state_dict(), "m.pt")\n\nsave(model)',
        '# a conversion tool in a torch.distributed package: it never runs as N processes\n'
        'def convert(src, dst):\n    torch.save(load_shards(src), dst)\n\nif __name__ == "__main__":\n    convert(*sys.argv[1:])',
    ],
    "DDP014": [
        'torch.cuda.set_device(local_rank)\nstate = torch.load("ckpt.pt", map_location="cpu")',
        'torch.cuda.set_device(local_rank)\nstate = torch.load("ckpt.pt", {"cuda:0": f"cuda:{local_rank}"})',
        'torch.cuda.set_device(local_rank)\nif rank == 0:\n    state = torch.load("ckpt.pt")\ndist.broadcast_object_list([state])',
        'dist.init_process_group("gloo", timeout=T)\nstate = torch.load("ckpt.pt")',
        'buf.seek(0)\ntorch.cuda.synchronize()\nstate = torch.load(io.BytesIO(data))',
        'model = DDP(net, device_ids=[rank])\ntorch.save(model, tmp.name)  # each rank its own temp file\n'
        'model = torch.load(tmp.name, weights_only=False)',
    ],
    "DDP015": [
        'model = DDP(model)\nif rank == 0:\n    torch.save(model.module.state_dict(), "m.pt")',
        'model = DDP(model) if ddp else model\nraw = model.module if ddp else model\nif rank == 0:\n'
        '    torch.save(raw.state_dict(), "m.pt")',
        'ddp_model = DDP(model)\nif rank == 0:\n    torch.save(ddp_model.state_dict(), p)\ndist.barrier()\n'
        'ddp_model.load_state_dict(torch.load(p, map_location=ml))',
        'model = DDP(model)\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\nif rank == 0:\n'
        '    torch.save(optimizer.state_dict(), "opt.pt")',
        'net = Net()\nmodel = DDP(net)\nif rank == 0:\n    torch.save(net.state_dict(), "m.pt")',
    ],
    "DDP016": [
        'if rank == 0:\n    ckpt = torch.load(p, map_location="cpu")\nelse:\n    ckpt = None',
        'if use_amp:\n    y = f(x)\nelse:\n    y = f(x)',
        'if rank == 0:\n    x = f()\nelif rank == 1:\n    x = g()\nelse:\n    x = f()',
    ],
}

SHELL_BROKEN = {
    "DDP101": [
        "torchrun \\\n    --nproc_per_node=4 \\   # <- GPUs per node\n    train.py",
        "torchrun --standalone \\ \n    train.py",   # a blank after the backslash  (line 1)
        "python train.py \\ # <- one blank: the comment becomes arguments\n  --lr 1",
    ],
    "DDP103": [
        "python -m torch.distributed.launch --nproc_per_node=2 --use_env train.py  # <-",
        "OMP_NUM_THREADS=1 python3 -m torch.distributed.launch \\\n  --nproc_per_node=8 train.py",  # line 1
    ],
    "DDP104": [
        "torchrun train.py --nproc_per_node=4 --epochs 3  # <-",
        "torchrun --standalone \\\n  train.py \\\n  --nnodes 2  # <-",
        "python -m torch.distributed.run -m pkg.train --nproc-per-node=2  # <-",
    ],
}

SHELL_LOOKALIKES = {
    "DDP101": [
        "# a comment about `cmd \\  # note`, which is text here",
        'echo "torchrun \\ # inside quotes"',
        "cat <<EOF\nnot a command \\  # just text\nEOF\necho done",
        "cp my\\ file.txt dest/",
        "torchrun \\\n    --nproc_per_node=4 \\\n    train.py  # a comment at the end is fine",
    ],
    "DDP103": [
        "torchrun --nproc_per_node=2 train.py",
        "python -m torch.distributed.run --nproc_per_node=2 train.py",
        '# we used to run: python -m torch.distributed.launch\necho "python -m torch.distributed.launch"',
    ],
    "DDP104": [
        "torchrun --nproc_per_node 4 --nnodes=1 train.py --lr 0.1 --epochs 3",
        "torchrun --standalone --nproc-per-node=2 train.py --nnodes-of-my-own 3",
        "srun --kill-on-bad-exit=1 python -m torch.distributed.run --nnodes=2 train.py \"$@\"",
        "which torchrun && echo train.py --nnodes=2",
    ],
}


def _cases(table):
    return [pytest.param(rule, code, id=f"{rule}-{i}") for rule, codes in table.items() for i, code in enumerate(codes)]


@pytest.mark.parametrize("rule, code", _cases(BROKEN))
def test_python_rule_flags_broken_code(rule, code):
    assert lines(HEAD + code, rule) == [n + 4 for n in marked(code)]


@pytest.mark.parametrize("rule, code", _cases(LOOKALIKES))
def test_python_rule_leaves_correct_lookalikes_alone(rule, code):
    assert lines(HEAD + code, rule) == []


@pytest.mark.parametrize("rule, code", _cases(SHELL_BROKEN))
def test_shell_rule_flags_broken_commands(rule, code):
    expected = marked(code) or [1]
    assert lines(code, rule, "shell") == expected


@pytest.mark.parametrize("rule, code", _cases(SHELL_LOOKALIKES))
def test_shell_rule_leaves_correct_commands_alone(rule, code):
    assert lines(code, rule, "shell") == []


def test_every_rule_has_broken_examples_and_lookalikes():
    import test_check_new_classes as newest  # DDP021-DDP023 keep theirs there
    import test_check_field_rules as field  # DDP024-DDP027 keep theirs there
    import test_check_new_rules as newer  # the rules from DDP017 and DDP105 on keep theirs there
    for rule in check.RULES:
        python = check.RULES[rule].kind == "python"
        broken = {**(BROKEN if python else SHELL_BROKEN), **(newer.BROKEN if python else newer.SHELL_BROKEN),
                  **(newest.BROKEN if python else {}), **(field.BROKEN if python else {})}
        fine = {**(LOOKALIKES if python else SHELL_LOOKALIKES),
                **(newer.LOOKALIKES if python else newer.SHELL_LOOKALIKES), **(newest.LOOKALIKES if python else {}), **(field.LOOKALIKES if python else {})}
        if rule == "DDP102":  # notebook-only: see the two tests below
            continue
        assert broken.get(rule) and fine.get(rule), rule


def test_ddp102_flags_torchrun_from_a_bang_line():
    nb = notebook("import sys\n!torchrun --nproc_per_node=2 train.py",
                  "!{sys.executable} -m torch.distributed.run --nproc_per_node=2 train.py",
                  "!CUDA_VISIBLE_DEVICES=0,1 torchrun train.py",
                  "out = %sx torchrun --standalone train.py")
    found = [(f.cell, f.line) for f in check.source(nb, "notebook") if f.id == "DDP102"]
    assert found == [(1, 2), (2, 1), (3, 1), (4, 1)]


def test_one_cell_can_be_checked_as_it_is():
    assert [(f.id, f.line) for f in check.source("import sys\n!torchrun --nproc_per_node=2 train.py", "cell")] == \
        [("DDP102", 2)]


def test_ddp102_leaves_other_bang_lines_and_python_launches_alone():
    nb = notebook("!nvidia-smi\n!which torchrun\n!pip list | grep torch",
                  "import subprocess, sys\nsubprocess.run([sys.executable, '-m', 'torch.distributed.run', 'train.py'], check=True)",
                  "%%bash\ntorchrun --standalone --nproc_per_node=2 train.py")
    assert [f.id for f in check.source(nb, "notebook")] == []


def test_findings_in_a_script_are_not_rules_for_the_notebook_kernel():
    # The kernel is one process: "every rank saves" cannot happen there, but it can in a %%writefile program.
    save = ("import torch.distributed as dist\nimport torch\ndist.init_process_group('gloo', timeout=T)\n"
            "torch.save(model.module.state_dict(), 'm.pt')")
    assert [f.id for f in check.source(notebook(save), "notebook")] == []
    written = check.source(notebook("%%writefile train.py\n" + save), "notebook")
    assert [(f.id, f.cell, f.line) for f in written] == [("DDP013", 1, 5)]


def test_notebook_lines_are_cell_lines_and_unparseable_cells_are_skipped():
    nb = notebook("%matplotlib inline\nimport torch", "x?", "files = !ls\nwith torch.cuda.amp.autocast():\n    pass")
    assert [(f.id, f.cell, f.line, f.col) for f in check.source(nb, "notebook")] == [("DDP012", 3, 2, 6)]


def test_a_notebook_of_cells_is_one_program():
    # the sampler in one cell, the epoch loop in another: they share the kernel's namespace
    nb = notebook("from torch.utils.data import DistributedSampler\nsampler = DistributedSampler(ds)",
                  "for epoch in range(3):\n    for x in DataLoader(ds, sampler=sampler):\n        f(x)")
    assert [(f.id, f.cell, f.line) for f in check.source(nb, "notebook")] == [("DDP007", 2, 1)]


@pytest.mark.parametrize("comment, suppressed", [
    ("# ddp-lab: ignore[DDP001]", True),
    ("# ddp-lab: ignore[DDP002, DDP001]", True),
    ("# ddp-lab: ignore", True),
    ("# ddp-lab: ignore[DDP002]", False),
    ("# noqa", False),
])
def test_ignore_comment_silences_only_the_named_rule(comment, suppressed):
    code = HEAD + f'dist.init_process_group("nccl", timeout=T)  {comment}\n'
    assert ("DDP001" not in [f.id for f in check.source(code)]) == suppressed


def test_ignore_comment_on_any_line_of_a_multiline_statement():
    code = HEAD + 'dist.init_process_group(\n    "nccl",\n    timeout=T,\n)  # ddp-lab: ignore[DDP001]\n'
    assert check.source(code) == []


def test_ignore_text_inside_a_string_does_not_count():
    code = HEAD + 'dist.init_process_group("nccl", timeout=T); s = "# ddp-lab: ignore[DDP001]"\n'
    assert [f.id for f in check.source(code)] == ["DDP001"]


def test_ignore_comment_in_shell():
    code = "torchrun train.py --nnodes=2  # ddp-lab: ignore[DDP104]\ntorchrun train.py --nnodes=2\n"
    assert [(f.id, f.line) for f in check.source(code, "shell")] == [("DDP104", 2)]


def test_select_and_ignore():
    code = HEAD + 'dist.init_process_group("nccl")\n'
    assert [f.id for f in check.source(code)] == ["DDP002", "DDP001"]
    assert [f.id for f in check.source(code, select=["DDP001"])] == ["DDP001"]
    assert [f.id for f in check.source(code, ignore=["DDP002"])] == ["DDP001"]


def test_finding_has_the_fix_and_the_notebook_section():
    f = check.source(HEAD + "import torch.cuda.amp\n")[0]
    assert (f.id, f.line, f.col) == ("DDP012", 5, 1)
    assert "torch.amp" in f.fix
    assert f.section == ("notebooks/04_mixed_precision.ipynb", check.SECTIONS["amp"][1])
    assert f.to_dict()["notebook"] == "notebooks/04_mixed_precision.ipynb"


def test_source_rejects_an_unknown_kind_and_unparseable_code():
    with pytest.raises(ValueError):
        check.source("x", kind="yaml")  # python, shell, cell or notebook
    with pytest.raises(check.Unreadable):
        check.source("def f(:\n")


def test_a_snippet_from_inside_a_function_is_enough():
    # as the notebooks quote the articles: a few lines, no imports
    snippet = textwrap.dedent("""
        if local_rank == 0:
            ckpt = torch.load(path, map_location=map_location)
        else:
            ckpt = torch.load(path, map_location=map_location)
    """)
    assert [(f.id, f.line) for f in check.source(snippet)] == [("DDP016", 2)]
