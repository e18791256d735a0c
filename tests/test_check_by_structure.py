"""ddp_lab.check knows a sampler, a launch, a collective, a rank and a `no_sync` by what the program
states, not by the names it uses: a class derived from DistributedSampler, a Python interpreter held
in a shell variable, torch.distributed.checkpoint under an alias, a rank handed to
init_process_group, `no_sync` reached through a context-manager helper. The files are in
tests/check_corpus/structure/: each `<name>.<ext>` has bugs planted on known lines, and
`<name>_clean.<ext>` is the same program written correctly. The inline cases below are smaller
variants: broken code is flagged on the lines marked `# <-`, the look-alikes stay quiet."""
from pathlib import Path

import pytest

from ddp_lab import check
from test_check_rules import HEAD, _cases, lines, marked

STRUCTURE = Path(__file__).resolve().parent / "check_corpus" / "structure"

# file -> [(rule, text on the line it must point at)]; nothing else may be reported in the file
PLANTED = {
    "sampler_subclass.py": [("DDP007", "    for epoch in range(3):")],
    "launch_python_var.sh": [("DDP104", "train.py --nproc_per_node=2"),
                             ("DDP103", "torch.distributed.launch"),
                             ("DDP105", "--master_port=29500")],
    "collective_on_main.py": [("DDP009", 'dcp.save(state, checkpoint_id=f"ckpt/step{step}")'),
                              ("DDP009", "comm.all_gather_object(counts, seen)")],
    "rank_by_statement.py": [("DDP009", "        dist.all_reduce(correct)"), ("DDP009", "        dist.barrier()")],
}


# 6. folders checked as one project: folder -> {file: [(rule, text on its line)]}; `<folder>_clean` is quiet
PROJECTS = {
    "accumulate_helper": {"train.py": [("DDP010", "            loss.backward()")], "sync_utils.py": []},
}


def line_of(text: str, snippet: str) -> int:
    assert text.count(snippet) == 1, f"{snippet!r} must occur exactly once"
    return text[:text.index(snippet)].count("\n") + 1


def clean_twin(name: str) -> str:
    stem, suffix = name.rsplit(".", 1)
    return f"{stem}_clean.{suffix}"


def test_every_structure_file_is_covered_and_has_a_clean_twin():
    on_disk = {p.name for p in STRUCTURE.iterdir() if p.is_file()}
    assert on_disk == set(PLANTED) | {clean_twin(n) for n in PLANTED}
    folders = {p.name for p in STRUCTURE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(PROJECTS) | {f"{n}_clean" for n in PROJECTS}


@pytest.mark.parametrize("name", sorted(PROJECTS))
def test_a_project_reports_its_planted_bugs_and_its_clean_twin_nothing(name):
    expected = sorted((file, line_of((STRUCTURE / name / file).read_text(encoding="utf-8"), snippet), rule)
                      for file, bugs in PROJECTS[name].items() for rule, snippet in bugs)
    findings, errors, checked = check.check_paths([STRUCTURE / name])
    assert errors == [] and checked == len(PROJECTS[name])
    assert sorted((Path(f.path).name, f.line, f.id) for f in findings) == expected
    findings, errors, _ = check.check_paths([STRUCTURE / f"{name}_clean"])
    assert errors == [] and [f"{f.location()}: {f.id} {f.message}" for f in findings] == []


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_bugs_are_found_on_their_lines_and_nothing_else(name):
    text = (STRUCTURE / name).read_text(encoding="utf-8")
    expected = sorted((line_of(text, snippet), rule) for rule, snippet in PLANTED[name])
    assert sorted((f.line, f.id) for f in check.check_file(STRUCTURE / name)) == expected


@pytest.mark.parametrize("name", sorted(clean_twin(n) for n in PLANTED))
def test_the_clean_twin_reports_nothing(name):
    assert [f"{f.location()}: {f.id} {f.message}" for f in check.check_file(STRUCTURE / name)] == []


WINDOW = ("for step, x in enumerate(loader):\n    with {ctx}:\n        model(x).sum().backward()  # <-\n"
          "    if (step + 1) % k == 0:\n        opt.step()")
LOOP = "for epoch in range(9):  # <-\n    for x in loader:\n        model(x).sum().backward()\n        opt.step()"
BROKEN = {
    # 2. a class derived from DistributedSampler, however it was imported and however deep
    "DDP007": [
        f"class S(DistributedSampler):\n    pass\n\nsampler = S(ds)\nloader = DataLoader(ds, sampler=sampler)\n{LOOP}",
        "from torch.utils.data import DistributedSampler as DS\n\nclass A(DS):\n    pass\n\nclass B(A):\n    pass\n\n"
        f"sampler = B(ds, shuffle=True)\n{LOOP}",
        f"class S(torch.utils.data.distributed.DistributedSampler):\n    pass\n\nsampler = S(ds)\n{LOOP}",
    ],
    # 4. collectives the checker knows by what they are: torch.distributed.checkpoint under any import,
    # torch.distributed under any alias, any object's barrier
    "DDP009": [
        "import torch.distributed.checkpoint as dcp\nif rank == 0:\n    dcp.save(state, checkpoint_id='c')  # <-",
        "import torch.distributed.checkpoint as dcp\nif rank == 0:\n    dcp.load(state, checkpoint_id='c')  # <-",
        "if rank == 0:\n    torch.distributed.checkpoint.save(state, checkpoint_id='c')  # <-",
        "from torch.distributed.checkpoint import save as write_shards\nif rank == 0:\n"
        "    write_shards(state, checkpoint_id='c')  # <-",
        "import torch.distributed as D\nif rank == 0:\n    D.barrier()  # <-",
        "from torch.distributed import all_gather_object\nif rank == 0:\n    all_gather_object(out, obj)  # <-",
        "if rank == 0:\n    dist.all_gather_object(out, obj)  # <-",
        "if trainer.is_global_zero:\n    trainer.strategy.barrier()  # <-",
        "if accelerator.is_main_process:\n    accelerator.wait_for_everyone()  # <-",
        "def save(fabric, state):\n    if fabric.global_rank == 0:\n        fabric.barrier()  # <-",
        # 5. a rank is what the program says it is: the name handed to init_process_group, get_rank() kept
        "def work(i, n):\n    dist.init_process_group('gloo', rank=i, world_size=n)\n    if i == 0:\n"
        "        dist.barrier()  # <-",
        "def work(i, n):\n    dist.init_process_group('gloo', 'env://', None, n, i)\n    if i == 0:\n"
        "        dist.barrier()  # <-",
        "r = dist.get_rank()\nlead = r == 0\nif lead:\n    dist.barrier()  # <-",
        "who = dist.get_rank() if dist.is_initialized() else 0\nif who == 0:\n    dist.barrier()  # <-",
        "class T:\n    def __init__(self):\n        self.me = torch.distributed.get_rank()\n\n    def end(self):\n"
        "        if self.me == 0:\n            dist.all_reduce(t)  # <-",
    ],
    # 6. a context manager that never turns sync off is no no_sync, however it is reached
    "DDP010": [
        f"model = DDP(net)\nctx = contextlib.nullcontext\n{WINDOW.format(ctx='ctx()')}",
        "model = DDP(net)\n\ndef quiet(m, on):\n"
        "    return torch.autocast('cpu') if on else contextlib.nullcontext()\n\n"
        f"{WINDOW.format(ctx='quiet(model, step % k != 0)')}",
    ],
}
LOOKALIKES = {
    "DDP007": [
        f"class S(DistributedSampler):\n    pass\n\nsampler = S(ds)\n{LOOP.replace('  # <-', '')}"
        "\n    sampler.set_epoch(epoch)",
        f"class S(DistributedSampler):\n    pass\n\nsampler = S(ds, shuffle=False)\n{LOOP.replace('  # <-', '')}",
        # a sampler of its own, not derived from DistributedSampler: nothing to say about its epochs
        f"class S(torch.utils.data.Sampler):\n    pass\n\nsampler = S(ds)\n{LOOP.replace('  # <-', '')}",
    ],
    "DDP009": [
        "import torch.distributed.checkpoint as dcp\ndcp.save(state, checkpoint_id='c')\nif rank == 0:\n"
        "    print('saved')",
        "if rank == 0:\n    torch.save(state, 'c.pt')\n    np.save('a.npy', a)\n    json.load(f)",
        "import torch.distributed as D\nif rank == 0:\n    D.barrier(group=pg)",   # a subgroup may be rank 0 alone
        "trainer.strategy.barrier()\nif trainer.is_global_zero:\n    print('done')",
        # a save of a module that merely shares the name
        "import checkpoint_utils as dcp\nif rank == 0:\n    dcp.save(state, 'c.pt')",
        # a name that is no rank: handed to init_process_group as something else, or a count
        "def work(i, n):\n    dist.init_process_group('gloo', rank=dist_rank(), world_size=i)\n    if i == 0:\n"
        "        dist.barrier()",
        "n = dist.get_world_size()\nif n == 0:\n    dist.barrier()",
        "who = dist.get_rank() if dist.is_initialized() else args.gpu\nif who == 0:\n    dist.barrier()",
        "r = dist.get_rank()\ndist.barrier()\nif r == 0:\n    print('all here')",
    ],
    "DDP010": [
        "model = DDP(net)\nctx = model.no_sync if accumulate else contextlib.nullcontext\n"
        f"{WINDOW.format(ctx='ctx()')}",
        f"model = DDP(net)\n\ndef maybe_sync(m, on):\n    return m.no_sync() if on else contextlib.nullcontext()\n\n"
        f"{WINDOW.format(ctx='maybe_sync(model, step % k != 0)')}",
        # a helper that enters no_sync itself, and one this file cannot read, handed the DDP model
        f"model = DDP(net)\n\n@contextlib.contextmanager\ndef window(m, on):\n    with contextlib.ExitStack() as s:\n"
        f"        if on:\n            s.enter_context(getattr(m, 'no_sync')())\n        yield\n\n"
        f"{WINDOW.format(ctx='window(model, step % k != 0)')}",
        f"from sync_utils import maybe_sync\nmodel = DDP(net)\n{WINDOW.format(ctx='maybe_sync(model, step % k)')}",
    ],
}


# 3. a Python interpreter held in a variable (or named python3) starts torchrun with `-m torch.distributed.run`
SHELL_BROKEN = {
    "DDP104": ['"$PY" -m torch.distributed.run train.py --nproc_per_node=2  # <-',
               '${PY} -u -m torch.distributed.run train.py --nnodes=2  # <-',
               '$python_bin -X dev -m torch.distributed.run train.py --nproc_per_node 2  # <-',
               'OMP_NUM_THREADS=1 "$PYTHON" -m torch.distributed.run train.py --nproc_per_node=2  # <-'],
    "DDP103": ['PY=python3\n"$PY" -m torch.distributed.launch --nproc_per_node=2 train.py  # <-'],
    "DDP107": ['#SBATCH --ntasks-per-node=4  # <-\nsrun "$PY" -m torch.distributed.run --nproc_per_node=4 train.py'],
}
SHELL_LOOKALIKES = {
    "DDP104": ['"$PY" train.py --nproc_per_node=2',               # the script itself, no launcher
               '$RUNNER -m mypkg.run train.py --nproc_per_node=2',  # another module
               '"$PY" -m torch.distributed.run --nproc_per_node=2 train.py'],
    "DDP103": ['"$PY" -m torch.distributed.run --nproc_per_node=2 train.py'],
    "DDP107": ['#SBATCH --ntasks-per-node=1\nsrun "$PY" -m torch.distributed.run --nproc_per_node=4 train.py'],
}


@pytest.mark.parametrize("rule, code", _cases(SHELL_BROKEN))
def test_a_launch_through_a_variable_is_a_launch(rule, code):
    assert lines(code, rule, "shell") == marked(code)


@pytest.mark.parametrize("rule, code", _cases(SHELL_LOOKALIKES))
def test_a_variable_that_launches_nothing_stays_quiet(rule, code):
    assert lines(code, rule, "shell") == []


@pytest.mark.parametrize("rule, code", _cases(BROKEN))
def test_structure_is_recognised_whatever_the_names(rule, code):
    assert lines(HEAD + code, rule) == [n + 4 for n in marked(code)]


@pytest.mark.parametrize("rule, code", _cases(LOOKALIKES))
def test_structural_lookalikes_stay_quiet(rule, code):
    assert lines(HEAD + code, rule) == []


def test_fix_inserts_set_epoch_for_a_sampler_subclass():
    from ddp_lab.check import fix
    path = STRUCTURE / "sampler_subclass.py"
    plans, left = fix.plan(check.check_file(path))
    assert left == [] and "+        sampler.set_epoch(epoch)\n" in fix.diff(plans[0])


def test_train_ddp_without_its_set_epoch_is_reported(tmp_path):
    # scripts/train_ddp.py's ResumableSampler derives from DistributedSampler: its epochs need set_epoch
    source = (Path(__file__).resolve().parents[1] / "scripts" / "train_ddp.py").read_text(encoding="utf-8")
    assert "(DistributedSampler):" in source
    kept = [line for line in source.splitlines(keepends=True) if "sampler.set_epoch(" not in line]
    assert len(kept) == len(source.splitlines()) - 1
    copy = tmp_path / "train_ddp.py"
    copy.write_text("".join(kept), encoding="utf-8")
    assert [f.id for f in check.check_file(copy)] == ["DDP007"]
