"""ddp_lab.check on code in the styles of widely used training stacks (Lightning-style hooks,
Accelerate mixed with raw torch.distributed, fairseq and detectron2 engines, ImageNet's
main_worker, YOLO's module globals, torch.compile, @record entry points, launch scripts and
sweeps). The files are in tests/check_corpus/styles/, written for these tests in those shapes:
each `<name>.<ext>` has bugs planted on known lines, and `<name>_clean.<ext>` is the same program
written correctly."""
from pathlib import Path

import pytest

from ddp_lab import check

STYLES = Path(__file__).resolve().parent / "check_corpus" / "styles"

# file -> [(rule, text on the line it must point at)], as in test_check_corpus.py
PLANTED = {
    "lightning_hooks.py": [("DDP009", "dist.all_reduce(self.correct)"), ("DDP009", "dist.all_reduce(self.total)")],
    "accelerate_raw_dist.py": [("DDP009", "            dist.barrier()")],
    "fairseq_engine.py": [("DDP010", "loss.backward()")],
    "detectron2_engine.py": [("DDP004", "model.to(torch.device(cfg.device))")],
    "imagenet_main_worker.py": [("DDP018", "torch.cuda.set_device(args.rank)")],
    "yolo_globals.py": [("DDP006", "init_seeds(opt.seed + 1 + RANK)"),
                        ("DDP003", "if LOCAL_RANK in {-1, 0}:"),
                        ("DDP015", 'torch.save({"epoch": epoch, "model": model.state_dict()}')],
    "compile_after_wrap.py": [("DDP004", "model = model.to(memory_format=torch.channels_last)")],
    "record_entry.py": [("DDP002", 'dist.init_process_group(backend="nccl")'),
                        ("DDP001", 'dist.init_process_group(backend="nccl")'),
                        ("DDP018", "torch.cuda.set_device(rank)")],
    "sweep_launch.sh": [("DDP105", "--master_port=29500 train.py")],
    "two_runs_launch.sh": [("DDP105", "--master_port 29501 train.py --config b.yaml")],
}
RECALL = 0.85


def line_of(text: str, snippet: str) -> int:
    assert text.count(snippet) == 1, f"{snippet!r} must occur exactly once"
    return text[:text.index(snippet)].count("\n") + 1


def planted(name: str) -> set:
    text = (STYLES / name).read_text(encoding="utf-8")
    return {(line_of(text, snippet), rule) for rule, snippet in PLANTED[name]}


def found(name: str) -> set:
    return {(f.line, f.id) for f in check.check_file(STYLES / name)}


def clean_twin(name: str) -> str:
    stem, suffix = name.rsplit(".", 1)
    return f"{stem}_clean.{suffix}"


def test_every_style_file_is_covered_and_has_a_clean_twin():
    on_disk = {p.name for p in STYLES.iterdir() if p.is_file()}
    assert on_disk == set(PLANTED) | {clean_twin(n) for n in PLANTED}
    assert len(PLANTED) >= 8


def test_most_planted_bugs_are_found_on_their_line():
    bugs = {(name, *where) for name in PLANTED for where in planted(name)}
    hits = {(name, *where) for name in PLANTED for where in found(name)}
    missed = sorted(bugs - hits)
    assert len(bugs & hits) >= RECALL * len(bugs), f"missed: {missed}"


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_nothing_is_reported_beyond_the_planted_bugs(name):
    assert found(name) <= planted(name)


@pytest.mark.parametrize("name", sorted(clean_twin(n) for n in PLANTED))
def test_the_clean_twin_reports_nothing(name):
    assert [f"{f.location()}: {f.id} {f.message}" for f in check.check_file(STYLES / name)] == []
