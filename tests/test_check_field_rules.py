"""ddp_lab.check rules DDP024-DDP028 (a data set downloaded on every rank, the lr scaled by the world
size under a fixed global batch, a checkpoint torch.load refuses, FSDP2 accumulation that
reduce-scatters every micro-step, a mid-epoch checkpoint without the position in the epoch) and
DDP009's barrier in a helper called on rank 0 only. Short snippets (broken code marked `# <-`, and
correct look-alikes), then whole programs in tests/check_corpus/field/: each `<name>.py` has its
bugs on known lines, and `<name>_clean.py` is the same program written correctly. Pure AST."""
from pathlib import Path

import pytest

from ddp_lab import check
from test_check_rules import HEAD, _cases, lines, marked  # the same harness as the older rules

FIELD = Path(__file__).resolve().parent / "check_corpus" / "field"
LAUNCHED = 'dist.init_process_group("gloo", timeout=T)\n'
SPLIT = "world_size = dist.get_world_size()\nloader = DataLoader(data, batch_size=256 // world_size)\n"

BROKEN = {
    "DDP024": [
        LAUNCHED + 'train_set = datasets.CIFAR10("data", train=True, download=True)  # <-',
        LAUNCHED + 'from torchvision.datasets.utils import download_and_extract_archive\n'
        'download_and_extract_archive(URL, "data")  # <-',
        LAUNCHED + "def get_data(root):\n    return MNIST(root, download=True)\n"
        "for epoch in range(3):\n    data = get_data('data')  # <-",
        # rank 0 downloads, but nobody waits for it: the others open an empty folder
        LAUNCHED + 'if dist.get_rank() == 0:\n    datasets.CIFAR10("data", download=True)\n'
        'train_set = datasets.CIFAR10("data", download=False)  # <-',
        LAUNCHED + 'if rank == 0:\n    datasets.MNIST("data", download=True)\nelse:\n    time.sleep(60)\n'
        'train_set = datasets.MNIST("data")  # <-',
        # a rank test that is not around the download does not guard it
        LAUNCHED + "if rank == 0:\n    print('fetching')\nurllib.request.urlretrieve(URL, 'vocab.txt')  # <-",
    ],
    "DDP025": [
        SPLIT + "lr = 0.1 * world_size  # <-",
        SPLIT + "optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * dist.get_world_size())  # <-",
        "num_tasks = dist.get_world_size()\nper_rank_batch = args.global_batch // num_tasks\nargs.lr *= num_tasks  # <-",
        'per_gpu_bs = int(cfg.total_batch / int(os.environ["WORLD_SIZE"]))\n'
        'cfg.learning_rate = cfg.learning_rate * int(os.environ["WORLD_SIZE"])  # <-',
    ],
    "DDP026": [
        "model = DDP(net)\nargs = parser.parse_args()\n"
        "torch.save({'model': net.state_dict(), 'args': args}, 'c.pt')  # <-",
        "from dataclasses import dataclass\n@dataclass\nclass Cfg:\n    lr: float = 0.1\n"
        "model = DDP(net)\ncfg = Cfg()\nckpt = {'model': net.state_dict()}\nckpt['cfg'] = cfg  # <-\n"
        "torch.save(ckpt, 'c.pt')",
        "model = DDP(net)\ntorch.save(model, 'whole.pt')  # <-",
        "model = DDP(net)\nclass Trainer:\n    def save(self):\n        torch.save(self.model, 'whole.pt')  # <-",
        "def main(opt):\n    model = DDP(net)\n    torch.save({'opt': opt, 'model': net.state_dict()}, 'c.pt')  # <-\n"
        "main(parser.parse_args())",
    ],
    "DDP027": [
        "from torch.distributed.fsdp import fully_shard\nfully_shard(model)\nfor i, (x, y) in enumerate(loader):\n"
        "    crit(model(x), y).backward()  # <-\n    if (i + 1) % k == 0:\n        optimizer.step()",
        "fully_shard(model)\nfor micro in batches:\n    model(micro).sum().backward()  # <-\noptimizer.step()",
    ],
    "DDP028": [
        "model = DDP(net)\nckpt = torch.load('c.pt')\nstep = ckpt['step']\nfor epoch in range(ckpt['epoch'], 3):\n"
        "    for x, y in loader:\n        step += 1\n        if step % 100 == 0:\n"
        "            torch.save({'model': model.module.state_dict(), 'step': step, 'epoch': epoch}, 'c.pt')  # <-",
        # the dict filled in the loop, saved with torch.distributed.checkpoint
        "model = DDP(net)\nstate = {'model': model.state_dict()}\ndcp.load(state, checkpoint_id=path)\n"
        "for it, batch in enumerate(train_dataloader):\n    state['global_step'] = it\n    if it % k == 0:\n"
        "        dcp.save(state, checkpoint_id=path)  # <-",
        # the save in a helper called from the batch loop
        "model = DDP(net)\ndef checkpoint(step):\n    torch.save({'iteration': step}, 'c.pt')  # <-\n"
        "start = torch.load('c.pt')['iteration']\nfor step, (x, y) in enumerate(loader, start):\n"
        "    if step % 500 == 0:\n        checkpoint(step)",
    ],
    # DDP009: a barrier of any object, in a helper called on rank 0 only
    "DDP009": [
        "def export(trainer, m):\n    torch.save(m.state_dict(), 'best.pt')\n    trainer.strategy.barrier()\n"
        "if trainer.is_global_zero:\n    export(trainer, m)  # <-",
        "class Cb:\n    def _sync(self, acc):\n        acc.wait_for_everyone()\n    def on_end(self, acc):\n"
        "        if acc.is_main_process:\n            self._sync(acc)  # <-",
    ],
}

LOOKALIKES = {
    "DDP024": [
        # rank 0 downloads, the others wait, everyone opens without downloading
        LAUNCHED + 'if dist.get_rank() == 0:\n    datasets.CIFAR10("data", download=True)\ndist.barrier()\n'
        'train_set = datasets.CIFAR10("data", download=False)',
        # ... and the wait in a helper of the file (train_ddp.py's agree(): an all_gather_object)
        LAUNCHED + "def agree(err):\n    errors = [None] * dist.get_world_size()\n    dist.all_gather_object(errors, err)\n"
        'if dist.get_rank() == 0:\n    datasets.CIFAR10("data", download=True)\nagree(None)\n'
        'train_set = datasets.CIFAR10("data", download=False)',
        # once per node, for node-local disks
        LAUNCHED + 'local_rank = int(os.environ["LOCAL_RANK"])\nif local_rank == 0:\n'
        '    datasets.MNIST("/tmp/data", download=True)\ndist.barrier()',
        # Accelerate and Trainer: the main process goes first, the others wait
        LAUNCHED + "with accelerator.main_process_first():\n    data = datasets.MNIST('data', download=True)",
        # Hugging Face's fetches lock their cache
        LAUNCHED + "raw = load_dataset('wikitext', 'wikitext-2-raw-v1')\npath = hf_hub_download('gpt2', 'config.json')",
        # the download decided by the rank
        LAUNCHED + "data = datasets.MNIST('data', download=(rank == 0))",
    ],
    "DDP025": [
        # the per-rank batch is fixed, the global batch grows N times: the linear scaling rule
        "world_size = dist.get_world_size()\nloader = DataLoader(data, batch_size=32)\nlr = 0.1 * world_size",
        # the global batch is fixed and the lr is not scaled
        SPLIT + "lr = 0.1",
        # the lr follows the effective batch (MAE)
        SPLIT + "eff_batch_size = args.batch_size * dist.get_world_size()\nargs.lr = args.blr * eff_batch_size / 256",
        # the number of accumulation steps, not the batch, is divided (nanoGPT)
        "grad_accum_steps //= world_size\nlr = 6e-4 * world_size",
        # a world size that only feeds a computation (a scale), not the lr directly
        "cfg = auto_scale(cfg, dist.get_world_size())\nper_rank = cfg.ims_per_batch // world_size\n"
        "lr = cfg.base_lr * cfg.scale",
    ],
    "DDP026": [
        "model = DDP(net)\nargs = parser.parse_args()\n"
        "torch.save({'model': net.state_dict(), 'args': vars(args)}, 'c.pt')",
        "import dataclasses\nmodel = DDP(net)\ncfg = Cfg()\n"
        "torch.save({'model': model.module.state_dict(), 'cfg': dataclasses.asdict(cfg)}, 'c.pt')",
        # the program loads its own file with weights_only=False, knowingly
        "model = DDP(net)\nargs = parser.parse_args()\ntorch.save({'args': args}, 'c.pt')\n"
        "ckpt = torch.load('c.pt', weights_only=False)",
        # the classes are allowed
        "model = DDP(net)\nargs = parser.parse_args()\n"
        "torch.serialization.add_safe_globals([argparse.Namespace])\ntorch.save({'args': args}, 'c.pt')",
        # `args` is a Namespace in one function and a dict in the one that saves it
        "model = DDP(net)\ndef parse():\n    args = parser.parse_args()\n    return args\ndef save():\n"
        "    args = {'lr': 0.1}\n    torch.save({'args': args}, 'c.pt')",
        # `model` here is a state dict
        "model = DDP(net)\ndef export(net):\n    model = net.state_dict()\n    torch.save(model, 'w.pt')",
        # a name like model bound to a dict of tensors
        "model = DDP(net)\nstate = {'w': torch.zeros(1)}\nmodel_state = state\ntorch.save(model_state, 'c.pt')",
    ],
    "DDP027": [
        # sync only on the last micro-step of each window
        "fully_shard(model)\nfor i, (x, y) in enumerate(loader):\n    model.set_requires_gradient_sync((i + 1) % k == 0)\n"
        "    crit(model(x), y).backward()\n    if (i + 1) % k == 0:\n        optimizer.step()",
        # no accumulation: every backward's reduce-scatter feeds a step
        "fully_shard(model)\nfor x, y in loader:\n    crit(model(x), y).backward()\n    optimizer.step()",
        # FSDP1 has no_sync, and DDP010 speaks for it
        "model = FSDP(net)\nfor i, x in enumerate(loader):\n    model(x).sum().backward()\n"
        "    if (i + 1) % k == 0:\n        optimizer.step()",
    ],
    "DDP028": [
        # saved after the epoch, outside the batch loop
        "model = DDP(net)\nckpt = torch.load('c.pt')\nfor epoch in range(ckpt['epoch'], 3):\n    for x, y in loader:\n"
        "        step += 1\n    torch.save({'epoch': epoch, 'step': step}, 'c.pt')",
        # the batches done saved with the step, and skipped on resume
        "model = DDP(net)\nckpt = torch.load('c.pt')\nstart = ckpt['batch']\n"
        "for i, (x, y) in enumerate(itertools.islice(loader, start, None), start):\n"
        "    torch.save({'step': step, 'batch': i + 1}, 'c.pt')",
        # torchdata's StatefulDataLoader keeps its own position
        "model = DDP(net)\nloader = StatefulDataLoader(data, batch_size=32)\nckpt = torch.load('c.pt')\n"
        "loader.load_state_dict(ckpt['loader'])\nfor x in loader:\n"
        "    torch.save({'step': step, 'loader': loader.state_dict()}, 'c.pt')",
        # a sampler told where to start (the scripts' ResumableSampler)
        "model = DDP(net)\nckpt = torch.load('c.pt')\nsampler.start = ckpt['samples_in_epoch']\nfor x in loader:\n"
        "    torch.save({'step': step, 'samples_in_epoch': n}, 'c.pt')",
        # no resume: the checkpoints are only for evaluation elsewhere
        "model = DDP(net)\nfor step, x in enumerate(loader):\n    torch.save({'step': step}, f'c{step}.pt')",
        # random batches each step: no position in an epoch (nanoGPT)
        "model = DDP(net)\niter_num = torch.load('c.pt')['iter_num']\nwhile True:\n    X, Y = get_batch('train')\n"
        "    torch.save({'iter_num': iter_num}, 'c.pt')",
    ],
    "DDP009": [
        # the helper saves; the barrier is on every rank, after the if
        "def export(trainer, m):\n    torch.save(m.state_dict(), 'best.pt')\n"
        "if trainer.is_global_zero:\n    export(trainer, m)\ntrainer.strategy.barrier()",
    ],
}

# file -> [(rule, text on the line it must point at)]
PLANTED = {
    "download_every_rank.py": [
        ("DDP024", "train_set = datasets.MNIST(root, train=True, download=True"),
        ("DDP024", "labels = fetch_labels(root)"),
    ],
    "barrier_in_rank0_callback.py": [
        ("DDP009", "            self._export(trainer, pl_module)"),
        ("DDP009", '            publish(accelerator, model, f"epoch{epoch}.pt")'),
    ],
    "lr_scaled_fixed_global_batch.py": [("DDP025", "lr = args.base_lr * world_size")],
    "fsdp2_accumulation.py": [("DDP027", "        loss.backward()\n    optimizer.step()"),
                              ("DDP027", "        loss.backward()\n        if (step")],
    "mid_epoch_resume.py": [("DDP028", "                torch.save({")],
    "checkpoint_objects.py": [
        ("DDP026", '"args": args,'),
        ("DDP026", '"config": cfg}'),
        ("DDP026", 'torch.save(net, "final.pt")'),
    ],
}


@pytest.mark.parametrize("rule, code", _cases(BROKEN))
def test_rule_flags_broken_code(rule, code):
    assert lines(HEAD + code, rule) == [n + 4 for n in marked(code)]


@pytest.mark.parametrize("rule, code", _cases(LOOKALIKES))
def test_rule_leaves_correct_lookalikes_alone(rule, code):
    assert lines(HEAD + code, rule) == []


def test_quiet_in_one_process_and_in_a_notebook_kernel():
    # one process (no DDP at all, or the kernel): a download races with nothing, and a pickled
    # checkpoint is left to rules about DDP programs
    download = "train_set = datasets.MNIST('data', download=True)\n"
    assert lines("import torch\n" + download, "DDP024") == []
    assert [f.id for f in check.source(HEAD + LAUNCHED + download, "cell")] == []
    assert lines(HEAD + LAUNCHED + download, "DDP024") == [6]                    # the same line, launched N times
    save = "args = parser.parse_args()\ntorch.save({'args': args}, 'c.pt')\n"
    assert lines("import torch\n" + save, "DDP026") == []
    assert lines(HEAD + "model = DDP(net)\n" + save, "DDP026") == [7]


def line_of(text: str, snippet: str) -> int:
    assert text.count(snippet) == 1, f"{snippet!r} must occur exactly once"
    return text[:text.index(snippet)].count("\n") + 1


def planted(name: str) -> set:
    text = (FIELD / name).read_text(encoding="utf-8")
    return {(line_of(text, snippet), rule) for rule, snippet in PLANTED[name]}


def clean_twin(name: str) -> str:
    return name.replace(".py", "_clean.py")


def test_every_corpus_file_is_covered_and_has_a_clean_twin():
    on_disk = {p.name for p in FIELD.iterdir() if p.is_file()}
    assert on_disk == set(PLANTED) | {clean_twin(n) for n in PLANTED}
    rules = {rule for pairs in PLANTED.values() for rule, _ in pairs}
    assert rules == {"DDP009", "DDP024", "DDP025", "DDP026", "DDP027", "DDP028"}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_bugs_and_nothing_else_are_reported(name):
    assert {(f.line, f.id) for f in check.check_file(FIELD / name)} == planted(name)


@pytest.mark.parametrize("name", sorted(clean_twin(n) for n in PLANTED))
def test_the_clean_twin_reports_nothing(name):
    assert [f"{f.location()}: {f.id} {f.message}" for f in check.check_file(FIELD / name)] == []


def by_id(name: str) -> dict:
    out: dict = {}
    for f in check.check_file(FIELD / name):
        out.setdefault(f.id, []).append(f)
    return out


def test_messages_say_what_goes_wrong_and_fixes_say_what_to_write():
    direct, helper = by_id("download_every_rank.py")["DDP024"]
    assert direct.message.startswith("datasets.MNIST(...) downloads on every rank")
    assert helper.message.startswith("fetch_labels() downloads (urllib.request.urlretrieve, line 19)")
    assert "dist.barrier()" in direct.fix and "download=False" in direct.fix
    [lr] = by_id("lr_scaled_fixed_global_batch.py")["DDP025"]
    assert "`args.base_lr * world_size`" in lr.message and "`args.global_batch // world_size` (line 19)" in lr.message
    assert "N times too large" in lr.message and "drop `* world_size`" in lr.fix
    args, cfg, whole = by_id("checkpoint_objects.py")["DDP026"]
    assert args.message.startswith("`args` is an argparse.Namespace") and "weights_only=True" in args.message
    assert cfg.message.startswith("`cfg` is a dataclass (TrainConfig)")
    assert whole.message.startswith("torch.save(net) pickles a whole model") and "net.state_dict()" in whole.message
    assert all(s in args.fix for s in ("vars(args)", "dataclasses.asdict(cfg)", "model.state_dict()"))
    helper, loop = by_id("fsdp2_accumulation.py")["DDP027"]
    assert "reduce-scatters" in loop.message and "k-1 of every k" in loop.message
    assert "set_requires_gradient_sync(is_last)" in loop.fix and "ignore[DDP027]" in loop.fix
    [resume] = by_id("mid_epoch_resume.py")["DDP028"]
    assert "inside `for ... in loader:` (line 29)" in resume.message and "(torch.load, line 23)" in resume.message
    assert "trains those batches twice" in resume.message
    assert "islice" in resume.fix and "StatefulDataLoader" in resume.fix
    export, publish = by_id("barrier_in_rank0_callback.py")["DDP009"]
    assert "trainer.strategy.barrier() (line 15)" in export.message and "is_global_zero" in export.message
    assert "accelerator.wait_for_everyone() (line 26)" in publish.message


def test_the_new_rules_are_documented_and_left_to_a_hand_by_fix():
    from ddp_lab.check import fix
    for rule in ("DDP024", "DDP025", "DDP026", "DDP027", "DDP028"):
        assert check.RULES[rule].see == f"docs/check.md#{rule.lower()}"
    findings = [f for name in PLANTED for f in check.check_file(FIELD / name)]
    assert len(findings) == 11
    assert fix.plan(findings) == ([], [])


def test_a_fully_shard_model_gets_the_fsdp2_fix_not_no_sync():
    # FSDP2 models have no no_sync(): DDP010's fix would not run there
    loop = "for i, x in enumerate(loader):\n    model(x).sum().backward()\n    if (i + 1) % k == 0:\n        optimizer.step()"
    assert [f.id for f in check.source(HEAD + "model = DDP(net)\n" + loop)] == ["DDP010"]
    assert [f.id for f in check.source(HEAD + "fully_shard(model)\n" + loop)] == ["DDP027"]
