"""benchmarks/gpu_check.py (`make gpu-check`): what can be proved of it without a GPU.

Its CUDA checks run only on a GPU machine; here: the one line without CUDA, every command it
would start parses with the script's own parser (a flag that does not exist fails here, not on
the GPU), the figures it reads, the results document it writes, and its loop over real
processes (pass, fail, budget spent) with the machine faked.
"""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu_check = load(ROOT / "benchmarks" / "gpu_check.py")
MACHINE = {"gpus": 1, "name": "Test GPU", "smi": "Test GPU, 80 GiB, 999.1", "capability": "9.0",
           "native_bf16": True, "torch": "2.x", "cuda": "13.0", "nccl": "2.30.7"}


def test_without_cuda_one_line_exit_0_and_nothing_written(tmp_path):
    doc = tmp_path / "gpu_results.md"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--doc", str(doc),
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().count("\n") == 0 and "no CUDA device" in p.stdout, p.stdout
    assert not doc.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("nproc", [1, 2])
def test_every_script_command_parses_with_the_scripts_own_parser(tmp_path, nproc):
    parsers = {name: load(ROOT / "scripts" / name).parse_args for name in ("train_ddp.py", "allreduce_bench.py")}
    seen = set()
    for name, cmd, env, limit, figure in gpu_check.plan(tmp_path, nproc):
        if cmd is None:  # a row this machine cannot run (between GPUs, with one)
            continue
        scripts = [c for c in cmd if c.endswith(".py") and "/scripts/" in c]
        if not scripts:
            continue
        assert f"--nproc_per_node={nproc}" in cmd, (name, cmd)
        script = Path(scripts[0]).name
        parsers[script](cmd[cmd.index(scripts[0]) + 1:])  # SystemExit(2) on a flag that does not exist
        seen.add(script)
    assert seen == set(parsers)
    flags = [" ".join(c) for _, c, _, _, _ in gpu_check.plan(tmp_path, nproc) if c]
    for want in ("--precision fp16", "--sync-bn", "--compile", "--precision bf16",
                 "--precision fp32 --tf32 off", "--precision fp32 --tf32 auto"):  # TF32 by the flag users set
        assert any(want in f for f in flags), want
    assert any("tests" not in f and ".ipynb" in f for f in flags), "no nbval over the notebooks"


def test_checks_between_gpus_run_with_two_and_say_not_run_with_one(tmp_path, monkeypatch):
    """One GPU proves nothing between ranks: the 2-GPU rows are planned with 2 GPUs (SyncBatchNorm and a
    compression hook on NCCL ranks) and written "not run", with the reason, with one."""
    two = {name: cmd for name, cmd, *_ in gpu_check.plan(tmp_path, 2)}
    multi = [name for name, *_ in gpu_check.MULTI_GPU_RUNS]
    assert multi and all(two[n] and "--sync-bn" in two[n] and "--grad-compression" in two[n] for n in multi)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "machine", lambda: MACHINE)
    one = [job for job in gpu_check.plan(tmp_path, 1) if job[0] in multi]
    monkeypatch.setattr(gpu_check, "plan", lambda out, nproc, notebooks_at_once: one)
    doc = tmp_path / "gpu_results.md"
    assert gpu_check.main(["--out", str(tmp_path / "out"), "--doc", str(doc)]) == 0
    rows = [line for line in doc.read_text().splitlines() if line.startswith("| 2 GPUs")]
    assert rows and all("| not run | needs 2 or more GPUs" in r for r in rows), rows


def test_notebooks_with_cuda_cells_come_first_and_none_is_left_out():
    books = gpu_check.notebooks_first_gpu()
    every = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb")) + sorted((ROOT / "notebooks/solutions").glob("*.ipynb"))
    assert sorted(books) == sorted(every)
    names = [b.name for b in books]
    assert names.index("01_dataparallel_vs_ddp.ipynb") < names.index("03_ring_allreduce.ipynb")
    assert names[0] == "11_ddp_on_gpus.ipynb"  # the lesson that speaks most of GPUs


def test_jobs_run_the_notebooks_side_by_side_through_xdist(tmp_path):
    cmd = gpu_check.plan(tmp_path, 1, notebooks_at_once=3)[-1][1]
    assert cmd[cmd.index("-n") + 1] == "3" and "loadfile" in cmd  # a notebook's cells stay in one worker, in order
    assert "-n" not in gpu_check.plan(tmp_path, 1)[-1][1]


def test_figures_read_from_the_records(tmp_path):
    metrics = tmp_path / "m.jsonl"
    recs = [{"kind": "config"}, {"kind": "train", "samples_per_s": 9999, "loss": 9.0}]  # warm-up window
    recs += [{"kind": "train", "samples_per_s": v, "loss": loss} for v, loss in ((100, 2.5), (300, 2.0), (200, 1.25))]
    metrics.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    assert gpu_check.train_figure(metrics) == "200 samples/s, last loss 1.2500"
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({"world_size": 2, "results": [
        {"bytes": 2**20, "busbw": 10e9}, {"bytes": 2**28, "busbw": 350e9}, {"bytes": 2**27, "busbw": 300e9}]}))
    assert gpu_check.bench_figure(bench) == "busbw 350.0 GB/s at 256 MiB (world 2)"
    log = ("notebooks/01_a.ipynb::Cell 0 PASSED\nnotebooks/01_a.ipynb::Cell 1 FAILED\n"
           "notebooks/04_b.ipynb::Cell 0 PASSED\n")
    assert gpu_check.nbval_figure(log) == (False, "2 cells passed, 1 failed (01_a.ipynb)")


def test_dataparallel_check_runs_its_comparison_on_the_cpu():
    # Without CUDA, nn.DataParallel is the module itself: the comparison code still runs end to end.
    assert gpu_check.dataparallel_check([]).startswith("0 GPU(s), gradients equal")


def test_results_document_keeps_its_intro_and_earlier_runs(tmp_path):
    doc = tmp_path / "gpu_results.md"
    doc.write_text((ROOT / "docs" / "gpu_results.md").read_text())
    R = gpu_check.Result
    gpu_check.write_doc(doc, "2026-12-01 10:00 UTC", MACHINE, [R("train a", "pass", "1 samples/s", 3)])
    gpu_check.write_doc(doc, "2026-12-01 10:00 UTC", MACHINE, [R("train a", "pass", "1 samples/s", 3),
                                                               R("bench", "fail", "exit 1: x | y", 2)])
    gpu_check.write_doc(doc, "2026-12-02 09:00 UTC", MACHINE, [R("train a", "pass", "2 samples/s", 3)])
    text = doc.read_text()
    assert text.startswith("# GPU results\n") and "`make gpu-check`" in text
    assert "No GPU run has been recorded yet" not in text
    assert text.count("## 2026-12-01 10:00 UTC: 1 × Test GPU") == 1  # its second write replaced the first
    assert text.index("## 2026-12-02 09:00 UTC") < text.index("## 2026-12-01 10:00 UTC")
    assert "| bench | fail | exit 1: x / y | 2 |" in text and "| train a | pass | 2 samples/s | 3 |" in text


def test_the_loop_writes_each_result_and_stops_at_the_budget(tmp_path, monkeypatch):
    """Real processes with the machine faked: a pass, a failure, then the budget is spent."""
    py = sys.executable
    jobs = [("quick", [py, "-c", "print('one line')"], {}, 60, None),
            ("broken", [py, "-c", "import sys; print('it broke'); sys.exit(3)"], {}, 60, None),
            ("slow", [py, "-c", "import time; time.sleep(600)"], {}, 600, None),
            ("after", [py, "-c", "print('never')"], {}, 60, None)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "machine", lambda: MACHINE)
    monkeypatch.setattr(gpu_check, "plan", lambda out, nproc, notebooks_at_once: jobs)
    monkeypatch.setattr(gpu_check, "MIN_LEFT", 1)
    doc = tmp_path / "gpu_results.md"
    code = gpu_check.main(["--out", str(tmp_path / "out"), "--doc", str(doc), "--budget", "4"])
    assert code == 1  # a check that ran failed
    rows = [line for line in doc.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[:2] for r in rows] == [["| quick", "pass"], ["| broken", "fail"],
                                                  ["| slow", "fail"], ["| after", "not run"]], rows
    assert "one line" in rows[0] and "exit 3: it broke" in rows[1] and "timed out" in rows[2]


def test_only_runs_the_named_checks_and_lists_no_other_row(tmp_path, monkeypatch):
    py = sys.executable
    jobs = [("train a", [py, "-c", "print('trained')"], {}, 60, None),
            ("11: precision", [py, "-c", "print('tf32 ok')"], {}, 60, None)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "machine", lambda: MACHINE)
    monkeypatch.setattr(gpu_check, "plan", lambda out, nproc, notebooks_at_once: jobs)
    doc = tmp_path / "gpu_results.md"
    assert gpu_check.main(["--out", str(tmp_path / "out"), "--doc", str(doc), "--only", "11:"]) == 0
    rows = [line for line in doc.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows == ["| 11: precision | pass | tf32 ok | 0 |"], rows


def test_one_rank_all_reduce_says_there_is_no_link_to_measure(tmp_path):
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({"world_size": 1, "results": [{"bytes": 2**20, "busbw": 0.0}]}))
    assert "busbw is 0 by definition" in gpu_check.bench_figure(bench)


def test_compile_check_counts_graphs_on_a_model_class_and_fails_on_a_bare_sequential():
    """The CPU half of the compile check: on a model class with its own forward both orders hand the
    backend graphs (one per bucket), so the check passes; on a bare nn.Sequential, torch.compile(DDP(model))
    compiles nothing (Dynamo skips torch.nn's own frames) and the check fails instead of passing at 0 = 0."""
    from ddp_lab.lessons import models
    line = gpu_check.compile_check(devices=("cpu",))
    assert "torch.compile(DDP(model)) 0" not in line and "for " in line, line
    with pytest.raises(AssertionError, match="torch.compile"):
        gpu_check.compile_check(devices=("cpu",), make=models.wide_mlp)


def test_gpu_trace_figure_reads_kineto_steps_and_refuses_a_cpu_trace(tmp_path):
    """The 08 check's reader: a kineto-format trace (the synthetic one of test_profiling_gpu_model) gives
    a budget whose parts add up to the device's window; a real CPU trace of the same probe, run here with
    the flags the check passes, is refused as not a GPU trace."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_profiling_gpu_model import gpu_trace
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    (gpu / "rank1.json").write_text(json.dumps(gpu_trace()))
    line = gpu_check.trace_figure(gpu)
    assert line.startswith("1 rank(s), 1 GPU step(s): window 8.90 ms") and "NCCL kernels 2.50 ms" in line, line
    (cmd,) = [c for name, c, *_ in gpu_check.plan(tmp_path / "out", 1) if name.startswith("08:")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    with pytest.raises(ValueError, match="CPU trace"):
        gpu_check.trace_figure(tmp_path / "out" / "profile" / "wide_n1")


def test_the_nccl_hang_check_is_planned_with_two_gpus_only(tmp_path):
    rows = {name: cmd for name, cmd, *_ in gpu_check.plan(tmp_path, 2)}
    (hang,) = [n for n in rows if "Flight Recorder" in n]
    assert rows[hang][-4:] == ["--inner", "hang", "--out", str(tmp_path)]
    assert {name: cmd for name, cmd, *_ in gpu_check.plan(tmp_path, 1)}[hang] is None
    assert (ROOT / "benchmarks" / "gpu_hang.py").read_text().count("dist.all_reduce(") == 1
