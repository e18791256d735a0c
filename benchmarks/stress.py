"""Flaky is broken: run what starts processes many times in a row, under load, and count failures.

    .venv/bin/python benchmarks/stress.py                 # make stress: everything (about an hour, 2 cores)
    .venv/bin/python benchmarks/stress.py --runs 5 --passes 0 --test-passes 0   # the scripts only

1. scripts/train_ddp.py and scripts/minimal_ddp.py as 2-rank torchrun jobs, --runs times each,
   in --loops loops at once so the machine is busy (the configuration that used to abort at exit
   one run in five: --metrics-out set, a record every step).
2. Every notebook that launches programs (solutions included), --passes times in a row under
   nbval, as `make test` runs them.
3. The tests that start processes on the newer paths (the hang autopsy of six kinds of hang, the
   NaN skip and clipping, resume on shared and unshared storage, the exit-time release, what a
   launch and the live ranks listen on, the folders a launch and elastic agents leave, the doctor
   across two nodes), --test-passes times in a row under pytest, --test-jobs
   files at a time as `make test` runs them (each file beside another file's processes).
4. The browser tests (tests/e2e: JupyterLab in headless Chromium), --e2e-passes times in a row.
5. scripts/slurm_ddp.sbatch submitted --slurm-runs times in a row to one localhost SLURM of two
   nodes (ddp_lab.engine.slurm; where it cannot start, the line says why and nothing is counted).

Prints `N runs, K failures` for each part and in total, with the failing tests' names and the last
lines of every failure; the whole output of each failed run is kept in build/stress/ (the path is
printed). Exits 1 on any failure. Not part of `make test`: it measures reliability, it does not prove it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN_ARGS = ["--model", "mlp", "--optimizer", "adamw", "--epochs", "2", "--batch-size", "64",
              "--accum-steps", "2", "--log-every", "1", "--progress", "off"]


def torchrun(script: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            str(ROOT / "scripts" / script), *args]


def script_job(script: str, i: int, folder: Path) -> list[str]:
    if script == "train_ddp.py":
        return torchrun(script, [*TRAIN_ARGS, "--seed", str(i), "--metrics-out", str(folder / f"m{i}.jsonl")])
    return torchrun(script, [])


LOGS = ROOT / "build" / "stress"


def run_one(cmd: list[str], cwd: Path, env: dict, timeout: float) -> tuple[bool, str]:
    try:
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        ok, out, head = p.returncode == 0, p.stdout + p.stderr, f"exit {p.returncode}"
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        ok, head = False, f"timed out after {timeout:g} s"
    if ok:
        return True, ""
    LOGS.mkdir(parents=True, exist_ok=True)  # the whole output: a failure must be identifiable later
    log = LOGS / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{threading.get_ident() % 10000}.log"
    log.write_text(" ".join(cmd) + "\n\n" + out)
    failed = [line for line in out.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return False, "\n".join([f"{head} (whole output: {log})", *failed, out[-1500:]])


def stress_scripts(runs: int, loops: int, timeout: float) -> tuple[int, list[str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    failures, done, lock = [], [0], threading.Lock()
    total = 2 * runs
    with tempfile.TemporaryDirectory(prefix="ddp_lab_stress_") as d:
        folder = Path(d)
        jobs = [(s, i) for i in range(runs) for s in ("train_ddp.py", "minimal_ddp.py")]

        def one(job):
            script, i = job
            cwd = folder / f"{script}-{i}"
            cwd.mkdir()
            ok, tail = run_one(script_job(script, i, cwd), cwd, env, timeout)
            with lock:
                done[0] += 1
                if not ok:
                    failures.append(f"{script} run {i}: {tail}")
                print(f"\r  scripts: {done[0]}/{total} runs, {len(failures)} failures", end="", flush=True)

        with ThreadPoolExecutor(loops) as pool:
            list(pool.map(one, jobs))
    print()
    return total, failures


def launching_notebooks(names: str = "") -> list[Path]:
    found = []
    for nb in sorted((ROOT / "notebooks").rglob("*.ipynb")):
        # The Chinese edition (notebooks/zh/) runs the English cells byte for byte: stressed once, as English
        if {".ipynb_checkpoints", "zh"} & set(nb.relative_to(ROOT / "notebooks").parts[:-1]) or \
                (names and not any(n in nb.name for n in names.split(","))):
            continue
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        starts = ("launch.", "interactive.start", "elastic.")  # torchrun jobs, live ranks, agents
        if any(k in "".join(c["source"]) for c in cells if c["cell_type"] == "code" for k in starts):
            found.append(nb)
    return found


def stress_notebooks(passes: int, timeout: float, names: str) -> tuple[int, list[str]]:
    notebooks = launching_notebooks(names)
    failures, n = [], 0
    for p in range(passes):
        for nb in notebooks:
            n += 1
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(nb)]
            ok, tail = run_one(cmd, ROOT, dict(os.environ), timeout)
            if not ok:
                failures.append(f"pass {p + 1} {nb.relative_to(ROOT)}: {tail}")
            print(f"\r  notebooks: {n}/{passes * len(notebooks)} runs, {len(failures)} failures",
                  end="", flush=True)
    print()
    return n, failures


PROCESS_TESTS = ("tests/test_autopsy.py", "tests/test_train_ddp_steps.py",
                 "tests/test_train_ddp_resume.py", "tests/test_train_ddp_resume_shared.py",
                 "tests/test_exit_release.py", "tests/test_launch_rootcause.py",
                 "tests/test_train_ddp_dcp.py", "tests/test_grade.py", "tests/test_verify.py",
                 "tests/test_verify_ladder.py", "tests/test_netcluster.py", "tests/test_private_ports.py",
                 "tests/test_interactive.py", "tests/test_launch.py", "tests/test_elastic.py",
                 "tests/test_doctor.py")


def stress_tests(passes: int, timeout: float, files: str, label: str = "tests", jobs: int = 0) -> tuple[int, list[str]]:
    """Each file --passes times. jobs > 0: each pass is one pytest over all the files, `jobs` files at
    a time (pytest-xdist, as `make test` runs them), so every file runs beside another's processes."""
    chosen = [f for f in (files.split(",") if files else PROCESS_TESTS) if (ROOT / f).exists()]
    failures, n = [], 0
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    pytest += ["-n", str(jobs), "--dist", "loadfile"] if jobs else []
    groups = [chosen] if jobs else [[f] for f in chosen]  # one pytest per group
    for p in range(passes):
        for group in groups:
            ok, tail = run_one(pytest + group, ROOT, dict(os.environ), timeout * len(group))
            n += len(group)
            if not ok:
                named = {line.split()[1].split("::")[0] for line in tail.splitlines()
                         if line.startswith(("FAILED ", "ERROR ")) and len(line.split()) > 1}
                failures += [f"pass {p + 1} {f}: {tail}" for f in sorted(named) or [",".join(group)]]
            print(f"\r  {label}: {n}/{passes * len(chosen)} runs, {len(failures)} failures", end="", flush=True)
    print()
    return n, failures


def stress_slurm(runs: int, timeout: float) -> tuple[int, list[str]]:
    """slurm_ddp.sbatch, `runs` jobs one after the other on one SLURM: each must COMPLETE on both
    nodes, in one world of 2 ranks, and end with the same model as the first."""
    sys.path.insert(0, str(ROOT))
    from ddp_lab.engine import slurm
    ok, why = slurm.available()
    if not ok:
        print(f"  SLURM skipped: {why}")
        return 0, []
    failures, shas = [], set()
    with tempfile.TemporaryDirectory(prefix="stress_slurm_") as tmp, slurm.Slurm(nodes=2, link="1gbit") as s:
        for i in range(runs):
            out = Path(tmp, f"job{i}.out")
            try:
                job = s.sbatch(["--gpus-per-node=1", "--cpus-per-task=2", f"--output={out}", "scripts/slurm_ddp.sbatch",
                                "--max-steps", "12", "--log-every", "4"], wait=True, timeout=timeout)
                record, log = s.job(job), out.read_text() if out.exists() else ""
                sha = log.rsplit("params sha256 ", 1)[-1].split(".")[0] if "params sha256 " in log else None
                shas.add(sha)
                if record["JobState"] != "COMPLETED" or "world_size=2 " not in log or sha is None or len(shas) > 1:
                    failures.append(f"SLURM job {i}: {record['JobState']} {record['ExitCode']}, sha {sha}\n{log[-1500:]}")
            except (RuntimeError, TimeoutError) as e:
                failures.append(f"SLURM job {i}: {e}")
            print(f"\r  SLURM: {i + 1}/{runs} jobs, {len(failures)} failures", end="", flush=True)
    print()
    return runs, failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=30, help="2-rank jobs per script")
    ap.add_argument("--loops", type=int, default=2, help="jobs running at once")
    ap.add_argument("--passes", type=int, default=3, help="nbval passes over the launching notebooks")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per job or notebook")
    ap.add_argument("--notebooks", default="", help="only notebooks whose names contain one of these "
                    "comma-separated strings, e.g. 05_,07_")
    ap.add_argument("--test-passes", type=int, default=3, help="pytest passes over the process tests")
    ap.add_argument("--test-jobs", type=int, default=2, help="process-test files running at once, as "
                    "`make test` runs them (JOBS); 0: one file at a time")
    ap.add_argument("--tests", default="", help="comma-separated test files instead of the default "
                    "process tests: " + ", ".join(PROCESS_TESTS))
    ap.add_argument("--e2e-passes", type=int, default=3, help="passes over the browser tests "
                    "(tests/e2e, about 4 min each on 2 idle cores)")
    ap.add_argument("--slurm-runs", type=int, default=10, help="slurm_ddp.sbatch jobs in a row on a localhost "
                    "SLURM (needs root and Debian's slurmctld, slurmd, munge)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ddp_lab_stress_env_") as scratch:
        # the solution notebooks' verdicts never reach the learner's grades file, and torchrun's
        # per-rank logs (a torchelastic_* folder in the temp dir each time) go with this folder
        os.environ["DDP_LAB_GRADES"] = os.path.join(scratch, "grades.json")
        os.environ.setdefault("PET_LOG_DIR", os.path.join(scratch, "torchelastic"))
        return stress(a)


def stress(a) -> int:
    start = time.time()
    results = []
    if a.runs:
        print(f"scripts: train_ddp.py and minimal_ddp.py, {a.runs} runs each, {a.loops} at once")
        results.append(("scripts (2 ranks)", *stress_scripts(a.runs, a.loops, a.timeout)))
    if a.passes:
        print(f"notebooks: {len(launching_notebooks(a.notebooks))} launching notebooks, {a.passes} passes under nbval")
        results.append(("notebooks (nbval)", *stress_notebooks(a.passes, a.timeout, a.notebooks)))
    if a.test_passes:
        print(f"tests: {a.test_passes} passes under pytest, {a.test_jobs or 1} files at a time")
        results.append(("process tests (pytest)", *stress_tests(a.test_passes, a.timeout, a.tests, jobs=a.test_jobs)))
    if a.e2e_passes:
        print(f"browser tests: {a.e2e_passes} passes of tests/e2e")
        results.append(("browser tests (tests/e2e)",
                        *stress_tests(a.e2e_passes, max(a.timeout, 1800), "tests/e2e", "browser tests")))
    if a.slurm_runs:
        print(f"SLURM: slurm_ddp.sbatch, {a.slurm_runs} jobs in a row on two nodes")
        results.append(("SLURM jobs (sbatch)", *stress_slurm(a.slurm_runs, a.timeout)))
    for _, _, failures in results:
        for f in failures:
            print(f"\n--- failure: {f}")
    print()
    for name, n, failures in results:
        print(f"{name}: {n} runs, {len(failures)} failures")
    n, k = sum(r[1] for r in results), sum(len(r[2]) for r in results)
    print(f"total: {n} runs, {k} failures in {(time.time() - start) / 60:.1f} min")
    return 1 if k else 0


if __name__ == "__main__":
    sys.exit(main())
