"""`ddp-lab check` / `python -m ddp_lab.check`: output formats, exit codes, what gets checked,
and the links from rules to notebooks and docs."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_lab import check, cli

ROOT = Path(__file__).resolve().parents[1]
BROKEN = 'import torch.distributed as dist\ndist.init_process_group("nccl")\n'
CLEAN = "import torch\nprint(torch.__version__)\n"


def run(capsys, *argv):
    rc = cli.main(["check", *map(str, argv)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.fixture
def files(tmp_path):
    (tmp_path / "broken.py").write_text(BROKEN)
    (tmp_path / "clean.py").write_text(CLEAN)
    return tmp_path


def test_text_output_names_place_rule_fix_and_notebook(capsys, files):
    rc, out, _ = run(capsys, files / "broken.py")
    assert rc == 1
    lines = out.splitlines()
    assert lines[0] == f"{files / 'broken.py'}:2:1: DDP002 {check.RULES['DDP002'].sentence}"
    assert lines[1] == f"    fix: {check.RULES['DDP002'].fix}"
    assert lines[2].startswith("    see: notebooks/02_sampler_and_metrics.ipynb, section ")
    assert lines[3].startswith(f"{files / 'broken.py'}:2:25: DDP001 ")
    assert lines[-1] == "2 findings in 1 file (1 file checked)"


def test_clean_file_exits_0(capsys, files):
    rc, out, _ = run(capsys, files / "clean.py")
    assert (rc, out) == (0, "no DDP problems found (1 file checked)\n")


def test_json_output(capsys, files):
    rc, out, _ = run(capsys, "--format", "json", files)
    doc = json.loads(out)
    assert rc == 1 and doc["files_checked"] == 2 and doc["errors"] == []
    assert [(f["id"], f["line"], f["col"], f["cell"]) for f in doc["findings"]] == [("DDP002", 2, 1, None),
                                                                                     ("DDP001", 2, 25, None)]
    assert doc["findings"][1]["notebook"] == "notebooks/00_first_launch.ipynb"
    assert doc["findings"][1]["section"] == check.SECTIONS["backend"][1]


@pytest.mark.parametrize("name, content, why", [
    ("missing.py", None, "no such file"),
    ("bad.py", "def f(:\n", "cannot parse as Python"),
    ("bad.ipynb", "{not json", "not a notebook"),
    ("notes.txt", "hello", "not a Python file, shell script or notebook"),
])
def test_unreadable_input_exits_2_and_says_why(capsys, files, name, content, why):
    if content is not None:
        (files / name).write_text(content)
    rc, out, err = run(capsys, files / name, files / "broken.py")
    assert rc == 2
    assert "DDP001" in out  # the readable file is still checked
    assert f"{files / name}: error: " in err and why in err


def test_select_ignore_and_unknown_ids(capsys, files):
    assert run(capsys, "--select", "ddp001", "--concise", files / "broken.py")[1].count("DDP") == 1
    assert run(capsys, "--ignore", "DDP001,DDP002", files / "broken.py")[0] == 0
    rc, _, err = run(capsys, "--select", "DDP999", files / "broken.py")
    assert rc == 2 and "DDP999" in err


def test_folders_are_walked_without_virtualenvs_or_hidden_folders(capsys, tmp_path):
    for folder in (".venv/lib", ".git", "build", "src/pkg"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "train.py").write_text(BROKEN)
    (tmp_path / "src" / "launch.sbatch").write_text("#SBATCH -N 2\ntorchrun train.py --nnodes=2\n")
    (tmp_path / "src" / "run").write_text("#!/bin/bash\ntorchrun train.py --nnodes=2\n")  # named only explicitly
    rc, out, _ = run(capsys, "--concise", tmp_path)
    assert rc == 1 and out.count("src/pkg/train.py:") == 2 and out.count("launch.sbatch:") == 1
    assert ".venv" not in out and ".git" not in out and "build" not in out and "src/run" not in out
    assert "DDP104" in run(capsys, tmp_path / "src" / "run")[1]  # a #! line says what it is


def test_list_rules_prints_every_rule(capsys):
    rc, out, _ = run(capsys, "--list-rules")
    assert rc == 0 and [line.split()[0] for line in out.splitlines() if line.startswith("DDP")] == sorted(check.RULES)


def test_ddp_lab_without_a_subcommand_prints_help(capsys):
    assert cli.main([]) == 2
    assert "check" in capsys.readouterr().out


def test_module_entry_point_exit_codes_and_json(files):
    """The one test that starts processes: `python -m ddp_lab.check` as a user runs it."""
    def launch(*argv):
        return subprocess.run([sys.executable, "-m", "ddp_lab.check", *map(str, argv)], capture_output=True,
                              text=True, timeout=60, cwd=ROOT)
    assert launch(files / "clean.py").returncode == 0
    broken = launch("--format", "json", files / "broken.py")
    assert broken.returncode == 1 and [f["id"] for f in json.loads(broken.stdout)["findings"]] == ["DDP002", "DDP001"]
    missing = launch(files / "missing.py")
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_console_script_is_declared():
    tomllib = pytest.importorskip("tomllib")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["ddp-lab"] == "ddp_lab.cli:main"


def notebook_headings(path: Path) -> set:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return {line.lstrip("#").strip() for c in cells if c["cell_type"] == "markdown"
            for line in "".join(c["source"]).splitlines() if line.startswith("#")}


@pytest.mark.parametrize("key", sorted(check.SECTIONS))
def test_every_linked_notebook_section_exists(key):
    notebook, title = check.SECTIONS[key]
    assert title in notebook_headings(ROOT / notebook), f"{notebook} has no section {title!r}: update SECTIONS"


def docs_examples(rule_id: str) -> list:
    """(kind, code) of the code blocks in the rule's section of docs/check.md: flagged, then fixed."""
    text = (ROOT / "docs" / "check.md").read_text(encoding="utf-8")
    assert f"\n### {rule_id}\n" in text, f"docs/check.md has no section for {rule_id}"
    section = text.split(f"\n### {rule_id}\n", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    blocks = section.split("```")[1::2]
    kinds = {"python": "python", "bash": "shell", "ipython": "notebook"}
    out = []
    for block in blocks:
        lang, code = block.split("\n", 1)
        if lang == "ipython":
            code = json.dumps({"cells": [{"cell_type": "code", "source": code, "metadata": {}, "outputs": []}]})
        out.append((kinds[lang], code))
    return out


@pytest.mark.parametrize("rule_id", sorted(check.RULES))
def test_docs_show_each_rule_flagging_its_example_and_passing_the_fix(rule_id):
    (kind, broken), (fixed_kind, fixed) = docs_examples(rule_id)[:2]
    assert rule_id in [f.id for f in check.source(broken, kind)]
    assert rule_id not in [f.id for f in check.source(fixed, fixed_kind)]
    rule = check.RULES[rule_id]
    if rule.section:
        text = (ROOT / "docs" / "check.md").read_text(encoding="utf-8").split(f"\n### {rule_id}\n", 1)[1]
        assert Path(check.SECTIONS[rule.section][0]).name in text.split("\n### ", 1)[0]


def pre_commit_hooks() -> list:
    """.pre-commit-hooks.yaml, read with PyYAML when it is installed, else with a reader for the
    flat `- key: value` list this file is."""
    text = (ROOT / ".pre-commit-hooks.yaml").read_text(encoding="utf-8")
    try:
        import yaml
        return yaml.safe_load(text)
    except ImportError:
        hooks = []
        for line in text.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if line.startswith("- "):
                hooks.append({})
            name, value = line[2:].split(":", 1)
            value = value.strip()
            hooks[-1][name.strip()] = [v.strip() for v in value[1:-1].split(",")] if value.startswith("[") else value
        return hooks


def test_pre_commit_hook_runs_the_checker_on_the_files_it_is_given(capsys, tmp_path):
    [hook] = pre_commit_hooks()
    assert (hook["id"], hook["entry"], hook["language"]) == ("ddp-lab-check", "ddp-lab check", "python")
    assert set(hook["types_or"]) == {"python", "shell", "jupyter"}
    program, *args = hook["entry"].split()
    tomllib = pytest.importorskip("tomllib")
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"][program] == "ddp_lab.cli:main"
    # pre-commit runs `entry file file ...` with the staged files that match types_or
    (tmp_path / "a.py").write_text(BROKEN)
    (tmp_path / "b.sh").write_text("torchrun train.py --nnodes=2\n")
    (tmp_path / "c.ipynb").write_text(json.dumps({"cells": [{"cell_type": "code", "source": "!torchrun train.py"}]}))
    (tmp_path / "d.py").write_text(CLEAN)
    staged = [tmp_path / n for n in ("a.py", "b.sh", "c.ipynb", "d.py")]
    assert args == ["check"]
    rc = cli.main([*args, "--concise", *map(str, staged)])
    out = capsys.readouterr().out
    assert rc == 1 and out.endswith("4 findings in 3 files (4 files checked)\n")
    assert [line.split(": ")[1].split()[0] for line in out.splitlines()[:-1]] == ["DDP002", "DDP001", "DDP104", "DDP102"]
    assert cli.main([*args, str(staged[-1])]) == 0   # clean files let the commit through
