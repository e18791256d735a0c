"""ddp_lab.check on whole programs: the two articles' code (broken as published, and fixed),
realistic scripts in the styles people copy, and this project's own programs."""
import ast
import json
from pathlib import Path

import pytest

from ddp_lab import check

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "check_corpus"
ARTICLES = CORPUS / "articles"

# file -> [(rule, text on the line it must point at)]; everything else in the file must be quiet.
ARTICLE_BUGS = {
    "engineering_3_1_train.py": [
        ("DDP002", 'dist.init_process_group(backend="nccl")'),       # no timeout
        ("DDP001", 'dist.init_process_group(backend="nccl")'),       # hard-coded nccl
        ("DDP012", "scaler = torch.cuda.amp.GradScaler()"),
        ("DDP012", "with torch.cuda.amp.autocast():"),
        ("DDP003", "if batch_idx % 100 == 0 and local_rank == 0:"),  # LOCAL_RANK as identity
        ("DDP008", 'print(f"Epoch {epoch}, Step {batch_idx}, "'),    # rank 0's own loss
        ("DDP003", "    if local_rank == 0:\n        torch.save"),
    ],
    "engineering_3_2_launch.sh": [
        ("DDP101", "--nproc_per_node=4 \\  #"),
        ("DDP101", "--nnodes=2 \\  #"),
        ("DDP101", "--node_rank=0 \\  #"),
        ("DDP101", "--master_addr=10.0.0.1 \\  #"),
        ("DDP101", "--master_port=29500 \\  #"),
    ],
    "engineering_3_3_accumulator.py": [("DDP010", "scaled_loss.backward()")],
    "engineering_3_4_checkpoint.py": [("DDP016", "if local_rank == 0:")],
    "survey_3_4_train.py": [
        ("DDP002", "dist.init_process_group("),
        ("DDP001", 'backend="nccl",'),
        ("DDP006", "seed_everything(42 + rank)"),
        ("DDP005", "broadcast_buffers=False"),
    ],
    "survey_3_5_launch.sh": [],
    "survey_7_2_amp.py": [("DDP012", "scaler = torch.cuda.amp.GradScaler()"),
                          ("DDP012", "with torch.cuda.amp.autocast():")],
    "survey_7_3_accumulation.py": [("DDP010", "scaler.scale(loss).backward()")],
}

CORPUS_FINDINGS = {
    "tutorial_spawn.py": [("DDP002", 'dist.init_process_group("gloo", rank=rank, world_size=world_size)'),
                          ("DDP019", 'os.environ["MASTER_PORT"] = "12355"')],  # fixed port, spawned
    "plain_loop.py": [
        ("DDP001", 'dist.init_process_group(backend="nccl", timeout=timedelta(minutes=30))'),
        ("DDP007", "for epoch in range(args.epochs):"),
        ("DDP008", 'print(f"epoch {epoch} step {step} loss {loss.item():.4f}")'),
        ("DDP015", 'torch.save(model.state_dict(), f"mnist_epoch{epoch}.pt")'),
    ],
    "trainer_class.py": [
        ("DDP002", 'init_process_group(backend="nccl")'),
        ("DDP001", 'init_process_group(backend="nccl")'),
        ("DDP010", "self.scaler.scale(loss).backward()"),
        ("DDP003", "if self.local_rank == 0 and epoch % self.save_every == 0:"),
    ],
    "nanogpt_style.py": [
        ("DDP002", "init_process_group(backend=backend)"),
        ("DDP006", "torch.manual_seed(1337 + seed_offset)"),
        ("DDP008", 'print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms")'),
    ],
    "clean_template.py": [],
    "accelerate_style.py": [],
    "launch_copied.sh": [
        ("DDP101", "--nnodes=2 \\        # machines"),
        ("DDP103", "python -m torch.distributed.launch --nproc_per_node=4"),
        ("DDP104", "torchrun train.py --nproc_per_node=4"),
    ],
    "slurm_job.sbatch": [],
}

# (rule, cell, text on that line of the cell)
NOTEBOOK_FINDINGS = [
    ("DDP012", 2, "from torch.cuda.amp import autocast, GradScaler"),
    ("DDP010", 4, "loss.backward()"),
    ("DDP013", 4, 'torch.save(model.module.state_dict(), "model.pt")'),
    ("DDP102", 5, "!torchrun --nproc_per_node=2 train.py"),
    ("DDP101", 6, "--nproc_per_node=2 \\  # one process per GPU"),
]


def line_of(text: str, snippet: str) -> int:
    """The line where snippet starts; it must occur exactly once."""
    assert text.count(snippet) == 1, f"{snippet!r} must occur exactly once"
    return text[:text.index(snippet)].count("\n") + 1


def expected_lines(path: Path, bugs) -> list:
    text = path.read_text(encoding="utf-8")
    return sorted((line_of(text, snippet), rule) for rule, snippet in bugs)


def found_lines(path: Path) -> list:
    return sorted((f.line, f.id) for f in check.check_file(path))


@pytest.mark.parametrize("name", sorted(ARTICLE_BUGS))
def test_article_snippet_as_published_reports_each_bug_on_its_line(name):
    path = ARTICLES / name
    assert found_lines(path) == expected_lines(path, ARTICLE_BUGS[name])


@pytest.mark.parametrize("name", sorted(n for n in ARTICLE_BUGS if ARTICLE_BUGS[n]))
def test_article_snippet_fixed_reports_nothing(name):
    stem, suffix = name.rsplit(".", 1)
    assert found_lines(ARTICLES / f"{stem}_fixed.{suffix}") == []


def test_every_article_fixture_is_covered():
    on_disk = {p.name for p in ARTICLES.iterdir() if not p.stem.endswith("_fixed")}
    assert on_disk == set(ARTICLE_BUGS)


@pytest.mark.parametrize("name", sorted(CORPUS_FINDINGS))
def test_corpus_script_reports_exactly_its_expected_findings(name):
    path = CORPUS / name
    assert found_lines(path) == expected_lines(path, CORPUS_FINDINGS[name])


def test_corpus_notebook_reports_its_findings_by_cell_and_line():
    path = CORPUS / "notebook_finetune.ipynb"
    cells = ["".join(c["source"]) for c in json.loads(path.read_text(encoding="utf-8"))["cells"]]
    expected = sorted((cell, line_of(cells[cell - 1], snippet), rule) for rule, cell, snippet in NOTEBOOK_FINDINGS)
    assert sorted((f.cell, f.line, f.id) for f in check.check_file(path)) == expected


def test_every_corpus_file_is_covered():
    on_disk = {p.name for p in CORPUS.iterdir() if p.is_file() and p.name not in ("conftest.py", "__init__.py")}
    assert on_disk == set(CORPUS_FINDINGS) | {"notebook_finetune.ipynb"}


# This project's programs must check clean; the lesson probes that reproduce a bug on purpose
# carry `# ddp-lab: ignore[...]` on that line.
def own_programs():
    for pattern in ("scripts/*.py", "scripts/*.sh", "scripts/*.sbatch", "ddp_lab/experiments/*.py"):
        yield from sorted(ROOT.glob(pattern))


@pytest.mark.parametrize("path", list(own_programs()), ids=lambda p: str(p.relative_to(ROOT)))
def test_project_programs_check_clean(path):
    rel = str(path.relative_to(ROOT))
    assert [f"{f.location()}: {f.id} {f.message}" for f in check.check_file(path)] == [], rel


def test_survey_fixed_program_saves_atomically_with_its_scheduler_and_releases_ddp_first():
    # the linter passing the fixed copy proves nothing about the bugs it has no rule for: read the code
    tree = ast.parse((ARTICLES / "survey_3_4_train_fixed.py").read_text(encoding="utf-8"))
    funcs = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    calls = lambda node: [ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)]
    assert "os.replace" in calls(funcs["atomic_save"]) and "torch.save" not in calls(funcs["train"])
    saved = [c for c in ast.walk(funcs["train"]) if isinstance(c, ast.Call) and ast.unparse(c.func) == "atomic_save"]
    assert len(saved) == 1 and "scheduler" in [k.value for k in saved[0].args[0].keys]
    loop = next(n for n in funcs["train"].body if isinstance(n, ast.For))
    assert "dist.barrier" in calls(loop)
    tail = [ast.unparse(n) for n in funcs["train"].body[-2:]]
    assert tail[0].startswith("del model") and tail[1] == "cleanup()"
    assert calls(funcs["cleanup"]) == ["gc.collect", "dist.destroy_process_group"]
