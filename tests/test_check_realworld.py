"""ddp_lab.check on code shaped like real projects': the bug (or the correct code) is spread over
methods and helpers, behind branches and early exits. Each case below is one such shape; the
files are in tests/check_corpus/realworld/ (written for these tests in those projects' shapes)."""
from pathlib import Path

import pytest

from ddp_lab import check

REALWORLD = Path(__file__).resolve().parent / "check_corpus" / "realworld"

# (case, file, rule, [text on each line the rule must report]); [] = the rule must stay quiet.
CASES = [
    # bugs spread over methods and helpers
    ("epoch loop in train(), batch loop in _run_epoch()", "trainer_epoch_method.py", "DDP007",
     ["for epoch in range(max_epochs):"]),
    ("evaluate() all-reduces, called under is_main_process()", "dino_style_eval_on_main.py", "DDP009",
     ["acc = evaluate(model, val_loader, device)"]),
    ("backward, every-k test and optimizer.step in three methods", "hf_trainer_accumulation.py", "DDP010",
     ["tr_loss += self.training_step(self.model, inputs)"]),
    ("a seeding helper found by what it calls, seed + rank through a name", "mae_style_seed.py", "DDP006",
     ["seed_all(seed)\n    model = MaskedAutoencoder(64)"]),
    ("self.model converted to SyncBatchNorm in a method after __init__ wrapped it",
     "swin_style_syncbn_after_wrap.py", "DDP004", ["self.model = torch.nn.SyncBatchNorm.convert_sync_batchnorm"]),
    ("torch.save in a helper: the call site on every rank is reported", "torchvision_style_save_helper.py",
     "DDP013", ['save_checkpoint(checkpoint, os.path.join(args.output_dir, "checkpoint.pth"))']),
    # correct code in shapes that looked like bugs
    ('"nccl" after sys.exit when there is no GPU', "gpu_only_nccl.py", "DDP001", []),
    ('"nccl" after assert torch.cuda.is_available()', "moco_style_branches.py", "DDP001", []),
    (".cuda() in an elif branch exclusive with the DDP wrap", "moco_style_branches.py", "DDP004", []),
    ("bare torch.load in the branch without a GPU, map_location in the other", "moco_style_branches.py",
     "DDP014", []),
    ("loss all-reduced, then averaged in a meter that rank 0 logs", "timm_style_meter.py", "DDP008", []),
    ("grad_accum_steps is a setting, not an accuracy", "nanogpt_style_accum_config.py", "DDP008", []),
    ("torch.cuda.amp only as the fallback of torch.amp", "amp_fallback.py", "DDP012", []),
    ("validation loader not sharded: every rank scores the whole set", "val_unsharded.py", "DDP008", []),
    ("a callback writes on global zero, every rank meets at the barrier after it",
     "lightning_style_rank_zero_callback.py", "DDP009", []),
    ("load_dataset on every rank (a locked cache), a download under main_process_first()",
     "hf_run_clm_style_data.py", "DDP024", []),
    ("a download inside torch_distributed_zero_first(LOCAL_RANK)", "yolo_style_zero_first.py", "DDP024", []),
    ("per-GPU batch fixed, lr from the effective batch", "mae_style_lr_scaling.py", "DDP025", []),
    ("global batch split among workers, lr and batch rescaled together", "detectron2_style_batch_split.py",
     "DDP025", []),
    ("checkpoint of plain dicts; the dataclass config rebuilt on resume", "nanogpt_style_checkpoint.py", "DDP026", []),
    ("args in the checkpoint, read back with weights_only=False", "torchvision_style_args_in_checkpoint.py",
     "DDP026", []),
    ("FSDP2 accumulation inside accelerator.accumulate()", "accelerate_style_fsdp2_accumulation.py", "DDP027", []),
    ("a checkpoint every k iterations of random batches: no epoch position to lose",
     "nanogpt_style_random_batches.py", "DDP028", []),
    ("the batch loop in a helper, the checkpoint saved after each epoch", "torchvision_style_epoch_checkpoint.py",
     "DDP028", []),
]

# Every file: all its findings, so no other rule fires on it either. *_fixed.py: the fix, quiet.
FILES = {name: [(rule, text) for _, n, rule, texts in CASES if n == name for text in texts]
         for name in {c[1] for c in CASES}}
FILES.update({p.name: [] for p in REALWORLD.glob("*_fixed.py")})


def line_of(text: str, snippet: str) -> int:
    assert text.count(snippet) == 1, f"{snippet!r} must occur exactly once"
    return text[:text.index(snippet)].count("\n") + 1


def expected(name: str, pairs) -> list:
    text = (REALWORLD / name).read_text(encoding="utf-8")
    return sorted((line_of(text, snippet), rule) for rule, snippet in pairs)


@pytest.mark.parametrize("case, name, rule, texts", CASES, ids=[c[0] for c in CASES])
def test_realworld_shape(case, name, rule, texts):
    found = [(f.line, f.id) for f in check.check_file(REALWORLD / name, select=[rule])]
    assert sorted(found) == expected(name, [(rule, t) for t in texts])


@pytest.mark.parametrize("name", sorted(FILES))
def test_realworld_file_reports_exactly_its_findings(name):
    assert sorted((f.line, f.id) for f in check.check_file(REALWORLD / name)) == expected(name, FILES[name])


def test_every_realworld_file_is_covered():
    assert {p.name for p in REALWORLD.glob("*.py")} == set(FILES)


def test_a_helper_call_site_names_the_helper_and_its_line():
    text = (REALWORLD / "torchvision_style_save_helper.py").read_text(encoding="utf-8")
    [f] = check.check_file(REALWORLD / "torchvision_style_save_helper.py")
    assert f"line {line_of(text, 'torch.save(state, tmp)')}" in f.message and "save_checkpoint()" in f.message


HEAD = ("import os\nimport torch\nimport torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n")


def test_a_cached_data_set_loaded_without_map_location_is_not_a_checkpoint():
    # torchvision's classification reference caches its ImageFolder with torch.save and reads it back
    code = HEAD + ('torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))\ndist.init_process_group("nccl", timeout=T)\n'
                   'dataset, _ = torch.load(cache_path)\ncheckpoint = torch.load(ckpt_path)\n')
    assert [(f.id, f.line) for f in check.source(code, select=["DDP014"])] == [("DDP014", 8)]


def test_a_helper_whose_collective_depends_on_its_arguments_is_not_reported():
    # a timing helper that joins a barrier only when asked to (together=False on rank 0)
    code = HEAD + ("def timed(model, together=True):\n    if together:\n        dist.barrier()\n    return 1.0\n\n"
                   "def run(model):\n    if dist.get_rank() == 0:\n        baseline = timed(model, together=False)\n"
                   "    dist.barrier()\n    ddp_s = timed(DDP(model))\n")
    assert check.source(code, select=["DDP009"]) == []
    # unconditional, and only rank 0 calls it: the hang is reported where it is called
    called_on_rank0 = code.replace("    if together:\n        dist.barrier()\n", "    dist.barrier()\n").replace(
        "ddp_s = timed(DDP(model))", "ddp_s = 0.0")
    assert [f.line for f in check.source(called_on_rank0, select=["DDP009"])] == \
        [line_of(called_on_rank0, "baseline = timed(model, together=False)")]


def test_code_after_an_early_return_on_other_ranks_runs_on_rank_0_only():
    # open_clip's evaluate(): `if not is_master(args): return metrics`, then rank 0 scores the whole
    # (unsharded) validation set by itself and logs it
    code = HEAD + ("import logging\n\ndef evaluate(model, loader, args):\n    metrics = {}\n"
                   "    if not is_master(args):\n        return metrics\n    cumulative_loss = 0.0\n"
                   "    for i, (x, y) in enumerate(loader):\n        total_loss = model(x, y)\n"
                   "        cumulative_loss += total_loss\n        if is_master(args) and i % 100 == 0:\n"
                   '            logging.info(f"Clip Loss: {cumulative_loss / (i + 1):.6f}")\n    return metrics\n')
    assert check.source(code) == []
    # ... and a collective there is one the other ranks never join
    head, tail = code.rsplit("    return metrics\n", 1)
    skipped = head + "    dist.all_reduce(cumulative_loss)\n    return metrics\n" + tail
    assert [(f.id, f.line) for f in check.source(skipped)] == [("DDP009", line_of(skipped, "dist.all_reduce(cum"))]


# The quiet files above are quiet for the reasons they show: take those away and the rule speaks.
UNDONE = [
    ("lightning_style_rank_zero_callback.py", "DDP009",
     [("            self._log(f\"new best {loss:.4f} at epoch {trainer.current_epoch}\")\n        self._sync(trainer)",
       "            self._log(f\"new best {loss:.4f} at epoch {trainer.current_epoch}\")\n            self._sync(trainer)")],
     "            self._sync(trainer)"),
    ("hf_run_clm_style_data.py", "DDP024", [("    with accelerator.main_process_first():\n", "    if True:\n")],
     "probe = probe_images(Accelerator()"),
    ("yolo_style_zero_first.py", "DDP024", [("    with torch_distributed_zero_first(LOCAL_RANK):\n", "    if True:\n")],
     "data = datasets.CIFAR10(root"),
    ("mae_style_lr_scaling.py", "DDP025", [("batch_size=args.batch_size,", "batch_size=args.batch_size // num_tasks,"),
                                           ("args.blr * eff_batch_size / 256", "args.blr * num_tasks")],
     "args.lr = args.blr * num_tasks"),
    ("detectron2_style_batch_split.py", "DDP025", [("lr=cfg.SOLVER.BASE_LR,", "lr=cfg.SOLVER.BASE_LR * world_size,")],
     "lr=cfg.SOLVER.BASE_LR * world_size,"),
    ("nanogpt_style_checkpoint.py", "DDP026", [('"config": config,', '"config": gptconf,')], '"config": gptconf,'),
    ("torchvision_style_args_in_checkpoint.py", "DDP026", [(", weights_only=False)", ")")], '"args": args,'),
]


@pytest.mark.parametrize("name, rule, edits, reported", UNDONE, ids=[f"{u[1]}-{u[0]}" for u in UNDONE])
def test_without_its_reason_the_quiet_file_is_reported(name, rule, edits, reported):
    text = (REALWORLD / name).read_text(encoding="utf-8")
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    assert [f.line for f in check.source(text, select=[rule])] == [line_of(text, reported)]
