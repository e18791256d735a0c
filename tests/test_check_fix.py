"""`ddp-lab check --fix`: each safe rewrite shown as a diff (nothing written), applied with --write
(the file then checks clean for that rule, the rest byte for byte unchanged), and files the
checker cannot parse never touched."""
import pytest

from ddp_lab import check, cli

DDP_HEAD = "import torch\nimport torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"

# rule -> (file name, broken text, the text --fix --write must leave)
CASES = {
    "DDP012": ("amp.py",
               DDP_HEAD + 'scaler = torch.cuda.amp.GradScaler()  # fp16 ✓\n'
               's = torch.cuda.amp.GradScaler(init_scale=2.0 ** 16)\n'
               'with torch.cuda.amp.autocast(dtype=torch.float16):\n    y = model(x)\n'
               'with torch.cpu.amp.autocast():\n    y = model(x)\n',
               DDP_HEAD + 'scaler = torch.amp.GradScaler("cuda")  # fp16 ✓\n'
               's = torch.amp.GradScaler("cuda", init_scale=2.0 ** 16)\n'
               'with torch.amp.autocast("cuda", dtype=torch.float16):\n    y = model(x)\n'
               'with torch.amp.autocast("cpu"):\n    y = model(x)\n'),
    "DDP007": ("loop.py",
               "from torch.utils.data import DataLoader, DistributedSampler\n\n"
               "def main(ds):\n    sampler = DistributedSampler(ds)\n    loader = DataLoader(ds, sampler=sampler)\n"
               "    for epoch in range(3):\n        # one pass\n        for x in loader:\n            step(x)\n",
               "from torch.utils.data import DataLoader, DistributedSampler\n\n"
               "def main(ds):\n    sampler = DistributedSampler(ds)\n    loader = DataLoader(ds, sampler=sampler)\n"
               "    for epoch in range(3):\n        # one pass\n        sampler.set_epoch(epoch)\n"
               "        for x in loader:\n            step(x)\n"),
    "DDP015": ("save.py",
               DDP_HEAD + 'model = DDP(model)\nif dist.get_rank() == 0:\n'
               '    torch.save({"model": model.state_dict(), "step": 3}, "m.pt")\n',
               DDP_HEAD + 'model = DDP(model)\nif dist.get_rank() == 0:\n'
               '    torch.save({"model": model.module.state_dict(), "step": 3}, "m.pt")\n'),
    "DDP101": ("launch.sh",
               "#!/bin/bash\nset -e\n  torchrun \\\n    --nproc_per_node=4 \\  # GPUs per machine\n"
               "    --nnodes=2 \\   \n    --master_port=29500 \\  # a free port\n    train.py\necho done\n",
               "#!/bin/bash\nset -e\n  # --nproc_per_node=4: GPUs per machine\n  # --master_port=29500: a free port\n"
               "  torchrun \\\n    --nproc_per_node=4 \\\n"
               "    --nnodes=2 \\\n    --master_port=29500 \\\n    train.py\necho done\n"),
}


def run(capsys, *argv):
    rc = cli.main(["check", *map(str, argv)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.parametrize("rule", sorted(CASES))
def test_fix_shows_a_diff_and_writes_nothing(capsys, tmp_path, rule):
    name, broken, fixed = CASES[rule]
    path = tmp_path / name
    path.write_bytes(broken.encode())
    rc, out, _ = run(capsys, "--fix", "--select", rule, path)
    assert rc == 1 and path.read_bytes() == broken.encode()
    assert out.startswith(f"--- {path}\n+++ {path}\n@@ ")
    removed = [line[1:] for line in out.splitlines() if line.startswith("-") and not line.startswith("---")]
    added = [line[1:] for line in out.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert removed == [line for line in broken.splitlines() if line not in fixed.splitlines()]
    assert added == [line for line in fixed.splitlines() if line not in broken.splitlines()]
    assert "(run with --fix --write to apply)" in out


@pytest.mark.parametrize("rule", sorted(CASES))
def test_fix_write_rewrites_only_the_finding_and_the_file_checks_clean(capsys, tmp_path, rule):
    name, broken, fixed = CASES[rule]
    path = tmp_path / name
    path.write_bytes(broken.encode())
    assert rule in [f.id for f in check.check_file(path)]
    rc, out, _ = run(capsys, "--fix", "--write", "--select", rule, path)
    assert path.read_bytes() == fixed.encode()
    assert rule not in [f.id for f in check.check_file(path)]
    assert rc == 0 and out.endswith("; 0 left to fix by hand\n")


def test_windows_line_endings_and_an_encoding_declaration_are_kept(capsys, tmp_path):
    path = tmp_path / "crlf.py"
    text = "# -*- coding: latin-1 -*-\r\nimport torch\r\n# caf\xe9\r\nscaler = torch.cuda.amp.GradScaler()\r\n"
    path.write_bytes(text.encode("latin-1"))
    run(capsys, "--fix", "--write", path)
    assert path.read_bytes() == text.replace("torch.cuda.amp.GradScaler()", 'torch.amp.GradScaler("cuda")').encode("latin-1")


def test_findings_without_a_safe_rewrite_are_listed_and_left_alone(capsys, tmp_path):
    # a positional argument of torch.cuda.amp.autocast is `enabled`; torch.amp.autocast's second is dtype
    code = DDP_HEAD + "with torch.cuda.amp.autocast(True):\n    y = model(x)\nfrom torch.cuda.amp import GradScaler\n"
    path = tmp_path / "manual.py"
    path.write_text(code)
    rc, out, _ = run(capsys, "--fix", "--write", "--concise", path)
    assert rc == 1 and path.read_text() == code
    assert out.count("DDP012") == 2 and out.endswith("fixed 0 findings in 0 files; 2 left to fix by hand\n")


def test_write_never_touches_a_file_it_cannot_parse(capsys, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("scaler = torch.cuda.amp.GradScaler()\ndef f(:\n")
    good = tmp_path / "good.py"
    good.write_text(CASES["DDP012"][1])
    rc, out, err = run(capsys, "--fix", "--write", bad, good)
    assert rc == 2 and "cannot parse as Python" in err
    assert bad.read_text() == "scaler = torch.cuda.amp.GradScaler()\ndef f(:\n"
    assert good.read_text() == CASES["DDP012"][2]   # the readable file is still fixed


def test_notebooks_are_reported_not_rewritten(capsys, tmp_path):
    nb = tmp_path / "n.ipynb"
    nb.write_text('{"cells": [{"cell_type": "code", "source": "scaler = torch.cuda.amp.GradScaler()"}]}')
    before = nb.read_bytes()
    rc, out, _ = run(capsys, "--fix", "--write", nb)
    assert rc == 1 and nb.read_bytes() == before and "cell 1:1:10: DDP012" in out


@pytest.mark.parametrize("argv, message", [(["--write"], "--fix --write"), (["--fix", "--format", "json"], "--fix")])
def test_write_needs_fix_and_fix_needs_text_output(capsys, tmp_path, argv, message):
    path = tmp_path / "amp.py"
    path.write_text(CASES["DDP012"][1])
    rc, _, err = run(capsys, *argv, path)
    assert rc == 2 and message in err and path.read_text() == CASES["DDP012"][1]
