"""scripts/allreduce_bench.py: self-contained, nccl-tests arithmetic, JSON for the notebook."""
import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_lab.engine import launch

SCRIPT = Path(launch.script("allreduce_bench.py"))


def test_imports_only_torch_and_the_standard_library():
    tree = ast.parse(SCRIPT.read_text())
    roots = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module}
    allowed = set(sys.stdlib_module_names) | {"torch", "__future__"}
    assert roots <= allowed, roots - allowed


def test_two_rank_sweep_writes_json_with_busbw_equal_algbw_times_2_n_minus_1_over_n(tmp_path):
    out = tmp_path / "bench.json"
    run = launch.torchrun(str(SCRIPT), nproc=2, stream=False,
                          args=["--min-bytes", "1K", "--max-bytes", "64K", "--iters", "3",
                                "--warmup", "1", "--json-out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["world_size"] == 2 and doc["backend"] == "gloo"
    assert [r["bytes"] for r in doc["results"]] == [1024, 4096, 16384, 65536]
    for r in doc["results"]:
        assert r["time_s"] > 0
        assert r["algbw"] == pytest.approx(r["bytes"] / r["time_s"])
        assert r["busbw"] == pytest.approx(r["algbw"] * 2 * (2 - 1) / 2)
    assert any("busbw(GB/s)" in line for line in run.rank_lines[0])
    assert not (tmp_path / "bench.json.tmp").exists()


def test_runs_as_a_plain_single_process_program(tmp_path):
    out = tmp_path / "one.json"
    subprocess.run([sys.executable, str(SCRIPT), "--max-bytes", "4K", "--iters", "2", "--json-out", str(out)],
                   check=True, capture_output=True, timeout=120)
    doc = json.loads(out.read_text())
    assert doc["world_size"] == 1 and all(r["busbw"] == 0 for r in doc["results"])


def test_bad_output_folder_exits_non_zero_before_doing_anything(tmp_path):
    keep = tmp_path / "keep.json"
    keep.write_text("old")
    r = subprocess.run([sys.executable, str(SCRIPT), "--json-out", "/no/such/folder/x.json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "does not exist; create it first" in r.stderr
    assert "all_reduce sum" not in r.stdout  # nothing was measured
    assert keep.read_text() == "old"


def _load_bench():
    spec = importlib.util.spec_from_file_location("allreduce_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only: main() runs under __main__
    return module


@pytest.mark.parametrize("args, message", [
    (["--min-bytes", "1M", "--max-bytes", "1K"], "--min-bytes"),
    (["--max-bytes", "lots"], "not a size"),
    (["--iters", "0"], "--iters"),
    (["--factor", "1"], "--factor"),
])
def test_bad_arguments_give_one_clear_message(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        _load_bench().parse_args(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_size_parsing():
    bench = _load_bench()
    assert [bench.parse_size(t) for t in ("4096", "64K", "16M", "1G", "2kb")] == [4096, 2**16, 2**24, 2**30, 2048]
