"""Resume that scales: who reads the checkpoint in scripts/train_ddp.py.

When every rank sees rank 0's file (same size and mtime: shared storage), each rank reads it
itself; when another rank cannot see it, rank 0 reads it and sends it. Both resume bitwise, and
a file every rank reads and finds bad stops the job with one message, rank 0's. Four 2-rank jobs,
run side by side: a straight run; two crash drills (saved and killed at step 10, restarted by
torchrun, resumed to step 20), one with the checkpoint folder shared, one with rank 1 in a
working directory of its own (tests/programs/rank_cwd.py), where the relative --ckpt-dir names
nothing; the same drill with --ckpt-format dcp, which needs a folder every rank sees and says so;
and a resume from a file that is not a checkpoint.
"""
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ddp_lab.engine import launch

SCRIPT = launch.script("train_ddp.py")
RANK_CWD = Path(__file__).parent / "programs" / "rank_cwd.py"
COMMON = ["--batch-size", "64", "--max-steps", "20", "--log-every", "5"]
DRILL = ["--ckpt-dir", "ck", "--save-every", "10", "--crash-at-step", "10"]


def records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    d = tmp_path_factory.mktemp("shared_resume")
    for name in ("shared", "hidden", "rank1_disk", "hidden_dcp", "rank1_disk_dcp"):
        (d / name).mkdir()
    cwds = {"shared": [d / "shared"] * 2, "hidden": [d / "hidden", d / "rank1_disk"],
            "hidden_dcp": [d / "hidden_dcp", d / "rank1_disk_dcp"]}
    plans = {"straight": ([], 0, None)}
    plans.update({name: (DRILL + (["--ckpt-format", "dcp"] if name.endswith("dcp") else []), 1,
                         os.pathsep.join(map(str, dirs))) for name, dirs in cwds.items()})
    torch.save({"weights": torch.zeros(3)}, d / "not_a_checkpoint.pt")  # loads, but is not ours
    plans["bad"] = (["--resume", d / "not_a_checkpoint.pt"], 0, None)

    def run(name):
        extra, restarts, dirs = plans[name]
        args = [SCRIPT, *COMMON, *extra, "--metrics-out", d / f"{name}.jsonl"]
        try:
            return launch.torchrun(str(RANK_CWD), nproc=2, max_restarts=restarts, stream=False, timeout=400,
                                   args=args, env={"RANK_CWDS": dirs or os.pathsep.join([str(d)] * 2)})
        except launch.LaunchError as e:  # the bad file's job fails, as it should
            return e.run

    with ThreadPoolExecutor(len(plans)) as pool:
        runs = dict(zip(plans, pool.map(run, plans)))
    return d, runs


def resumed(d, name):
    recs = records(d / f"{name}.jsonl")
    (rec,) = [r for r in recs if r["kind"] == "resume"]
    (final,) = [r for r in recs if r["kind"] == "final"]
    return rec, final


def test_every_rank_reads_a_file_all_of_them_see(jobs):
    d, runs = jobs
    rec, final = resumed(d, "shared")
    assert (rec["attempt"], rec["step"], rec["read_by"]) == (1, 10, "every rank")
    assert runs["shared"].log.count("resume: every rank reads ck/last.pt itself (shared storage)") == 1
    assert "rank 0 reads" not in runs["shared"].log
    (straight,) = [r for r in records(d / "straight.jsonl") if r["kind"] == "final"]
    assert final["step"] == straight["step"] == 20
    assert final["params_sha256"] == straight["params_sha256"]  # bitwise the uninterrupted run


def test_rank_0_reads_and_sends_when_another_rank_cannot_see_it(jobs):
    d, runs = jobs
    rec, final = resumed(d, "hidden")
    assert (rec["attempt"], rec["step"], rec["read_by"]) == (1, 10, "rank 0")
    assert runs["hidden"].log.count(
        "resume: rank 0 reads ck/last.pt and sends it (other ranks cannot see the file)") == 1
    assert not (d / "rank1_disk" / "ck").exists()  # rank 1 really had no checkpoint folder
    _, shared = resumed(d, "shared")
    assert final["params_sha256"] == shared["params_sha256"]  # the same resumed model, either path


def test_a_sharded_checkpoint_that_another_rank_cannot_see_is_one_message_naming_the_fix(jobs):
    d, runs = jobs
    run = runs["hidden_dcp"]
    assert run.returncode != 0 and (d / "hidden_dcp" / "ck" / "last.dcp" / "meta.pt").exists(), run.log[-3000:]
    errors = [(r, l) for r, lines in run.rank_lines.items() for l in lines if l.startswith("error")]
    assert errors == [(0, "error: --ckpt-format dcp needs every rank to see 'ck/last.dcp' (shared storage): put "
                          "--ckpt-dir on a filesystem every node mounts, or use --ckpt-format pt")], errors
    assert not any("Traceback" in l for lines in run.rank_lines.values() for l in lines)


def test_a_bad_file_every_rank_reads_is_one_message_from_rank_0(jobs):
    d, runs = jobs
    run = runs["bad"]
    assert run.returncode != 0
    assert "resume: every rank reads" in run.log  # both ranks saw it and read it
    errors = [(r, l) for r, lines in run.rank_lines.items() for l in lines if l.startswith("error")]
    assert len(errors) == 1 and errors[0][0] == 0, errors
    assert "is not a train_ddp.py checkpoint" in errors[0][1], errors
    assert not any("Traceback" in l for lines in run.rank_lines.values() for l in lines)
    for name in ("straight", "shared", "hidden"):
        assert runs[name].returncode == 0, runs[name].log[-3000:]
