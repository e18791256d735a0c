"""ddp_lab.verify.findings on records made here (no launch): the shards come from torch's own
DistributedSampler, so the expectation is independent of the code under test. Last, one launch of a
single rank that fails at once: the runner leaves the caller's working directory alone."""
import torch
from torch.utils.data import DistributedSampler

from ddp_lab.verify.findings import analyse, comm_per_step, data_coverage, replica_divergence


def passes(n, world, epochs=2, set_epoch=True, rank_of=lambda r: r, step_per_pass=2):
    """Pass records as the observer writes them, from a real DistributedSampler per rank."""
    records = {}
    for r in range(world):
        s = DistributedSampler(range(n), num_replicas=world, rank=rank_of(r), shuffle=True, seed=0)
        recs = []
        for e in range(epochs):
            if set_epoch:
                s.set_epoch(e)
            order = list(s)
            recs.append({"kind": "pass", "loader": 0, "pass": e, "step": e * step_per_pass, "dataset_len": n,
                         "subset": False, "batch_size": 4, "drop_last": False, "count": len(order),
                         "indices": order,
                         "sampler": {"type": "DistributedSampler", "rank": rank_of(r), "num_replicas": world,
                                     "epoch": s.epoch, "shuffle": True, "drop_last": False, "seed": 0}})
        recs.append(step(epochs * step_per_pass))
        records[r] = recs
    return records


def step(n, rounds=1, params=None, buffers=None, lr=0.1, broadcast=True, ddp=1):
    return {"kind": "step", "step": n, "rounds": rounds, "buckets": rounds, "bytes": 40 * rounds, "ddp": ddp,
            "broadcast_buffers": broadcast, "params": params or {"w": "a"}, "buffers": buffers or {},
            "lr": [lr]}


def test_padding_of_an_uneven_sampler_is_not_an_overlap():
    notes = []
    assert data_coverage(passes(10, 3), 3, notes) == []  # 10 on 3 ranks: 2 padded samples repeated
    assert notes == []


def test_missing_set_epoch_is_found_at_the_second_pass():
    (f,) = data_coverage(passes(16, 2, set_epoch=False), 2, [])
    assert (f.category, f.rank, f.step) == ("data-coverage", 0, 3)
    assert "set_epoch" in f.fix


def test_local_rank_as_rank_names_the_sampler():
    (f,) = data_coverage(passes(16, 2, rank_of=lambda r: 0), 2, [])
    assert f.rank == 1 and "DistributedSampler(rank=0, num_replicas=2) on rank 1" in f.message


def test_an_evaluation_loader_is_not_a_training_loader():
    records = passes(16, 2)
    for r, recs in records.items():  # rank 0 evaluates on everything after training: no step in it
        recs.insert(-1, {**recs[0], "loader": 1, "pass": 0, "step": 4, "indices": list(range(16)),
                         "sampler": {"type": "SequentialSampler"}})
    assert data_coverage(records, 2, []) == []


def test_one_pass_is_said_not_compared():
    notes = []
    assert data_coverage(passes(16, 2, epochs=1), 2, notes) == []
    assert "one pass" in notes[0]


def test_buffers_count_only_without_broadcast_buffers():
    def records(broadcast):
        return {0: [step(1, buffers={"bn.running_mean": "x"}, broadcast=broadcast)],
                1: [step(1, buffers={"bn.running_mean": "y"}, broadcast=broadcast)]}
    assert replica_divergence(records(True), []) == []
    (f,) = replica_divergence(records(False), [])
    assert (f.rank, f.step) == (1, 1) and "bn.running_mean" in f.message


def test_the_first_diverging_step_is_named():
    recs = {0: [step(1), step(2, params={"w": "b", "v": "c"})], 1: [step(1), step(2, params={"w": "b", "v": "d"})]}
    (f,) = replica_divergence(recs, [])
    assert (f.rank, f.step) == (1, 2) and f.message.endswith(": v")


def test_a_step_a_rank_shadowed_under_join_is_not_compared():
    """Uneven inputs under Join: rank 0 ran out of data after step 3 and shadowed rank 1's 4th
    all-reduce (its parameters wait for Join's final sync); later steps are compared again."""
    def recs(joined):
        shadow = {**step(4, params={"w": "c"}), "joined": True} if joined else step(4, params={"w": "c"})
        return {0: [step(1), step(2, params={"w": "b"}), step(3, params={"w": "c"}), shadow,
                    step(5, params={"w": "e"})],
                1: [step(1), step(2, params={"w": "b"}), step(3, params={"w": "c"}), step(4, params={"w": "d"}),
                    step(5, params={"w": "e"})]}
    assert replica_divergence(recs(joined=True), []) == []
    assert comm_per_step(recs(joined=True), []) == []
    (f,) = replica_divergence(recs(joined=False), [])
    assert (f.rank, f.step) == (1, 4)
    (f,) = replica_divergence({**recs(joined=True), 1: recs(joined=True)[1][:4] + [step(5, params={"w": "x"})]}, [])
    assert (f.rank, f.step) == (1, 5)


def test_no_all_reduce_before_a_step_and_a_warm_up_step():
    warm = step(1, rounds=0, ddp=0)
    assert comm_per_step({0: [warm, step(2), step(3)]}, []) == []  # a warm-up before DDP is no finding
    (f,) = comm_per_step({0: [warm, step(2), step(3, rounds=0)]}, [])
    assert f.step == 3 and "no gradient all-reduce" in f.message
    (f,) = comm_per_step({0: [step(1, rounds=0, ddp=0)]}, [])
    assert "no DistributedDataParallel model" in f.message


def test_analyse_of_a_healthy_run_is_empty():
    assert analyse(passes(16, 2), 2, []) == []


def test_verify_never_changes_the_callers_working_directory(tmp_path, monkeypatch):
    """The ranks start in the scratch folder (the script's relative files land there); the calling
    process stays where it was, during the launch too (a notebook's other threads share it)."""
    import os
    import shutil

    from ddp_lab.engine import launch
    from ddp_lab.verify import verify

    script = tmp_path / "fails.py"  # the cheapest launch: one rank that writes a file, then fails
    script.write_text("import os\nopen('written.txt', 'w').write(os.getcwd())\nraise SystemExit('cannot go on')\n")
    caller = tmp_path / "caller"
    caller.mkdir()
    monkeypatch.chdir(caller)
    during, torchrun = [], launch.torchrun

    def watched(*a, **k):
        during.append(os.getcwd())
        return torchrun(*a, **k)
    monkeypatch.setattr(launch, "torchrun", watched)
    report = verify(str(script), nproc=1, keep=True)
    scratch = next(n.split(": ", 1)[1] for n in report.notes if n.startswith("scratch folder kept"))
    try:
        assert report.status == 2 and "cannot go on" in report.error, report.text()
        assert during == [str(caller)] and os.getcwd() == str(caller)
        assert list(caller.iterdir()) == []
        work = os.path.join(scratch, "world1", "work")
        with open(os.path.join(work, "written.txt")) as f:
            assert os.path.realpath(f.read()) == os.path.realpath(work)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def test_a_rank_that_raised_while_the_others_waited_failed_it_did_not_hang(tmp_path):
    """The autopsy calls it "missing" (rank 0 never reached the barrier): its own error is the cause,
    so verify says the script cannot run (exit status 2) instead of reporting a hang."""
    from ddp_lab.autopsy.diagnose import Diagnosis, RankState
    from ddp_lab.verify.runner import _hang

    class Failed(Exception):
        def __init__(self, message, exception):
            super().__init__(message)
            self.autopsy = Diagnosis("rank 1 was waiting in barrier #23; rank 0 never reached collective #23",
                                     {0: RankState(0, "failed", exception=exception), 1: RankState(1, "waiting")},
                                     "missing")
    assert _hang(Failed("RuntimeError on rank 0", "RuntimeError: Parent directory out does not exist."),
                 tmp_path, 2) is None
    lost = _hang(Failed("rank 0 lost its peers", "DistBackendError: Connection reset by peer"), tmp_path, 2)
    assert lost is not None and lost.category == "hang" and lost.rank == 0


# -- the data set a loader wraps: records written by the observer itself, from real loaders ----------

def _observer_module():
    """ddp_lab/verify/_inject/sitecustomize.py loaded under another name: it arms nothing here
    (DDP_LAB_VERIFY_DIR is unset) and is not on sys.path, so it chains to nothing."""
    import importlib.util
    import os

    from ddp_lab.verify.runner import INJECT
    assert "DDP_LAB_VERIFY_DIR" not in os.environ
    spec = importlib.util.spec_from_file_location("verify_observer", INJECT / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def observed(tmp_path, loaders):
    """{rank: records}: the observer's record of one pass of each rank's loader, then a step."""
    import json
    observer = _observer_module()
    tmp_path.mkdir(exist_ok=True)
    records = {}
    for r, loader in enumerate(loaders):
        obs = observer._Observer(str(tmp_path), r)
        obs.loader_pass(iter(loader), loader)  # what the patched DataLoader iterator calls
        with open(obs.path) as f:
            records[r] = [json.loads(line) for line in f] + [step(2)]
    return records


def data(n):
    from torch.utils.data import TensorDataset
    return TensorDataset(torch.arange(n, dtype=torch.float32))


def test_a_training_subset_is_covered_against_itself_not_the_held_out_rest(tmp_path):
    """80 samples, 64 of them the training Subset: the 16 held out are no rank's to draw."""
    from torch.utils.data import DataLoader, Subset

    from ddp_lab.verify.findings import checked
    perm = torch.randperm(80, generator=torch.Generator().manual_seed(0)).tolist()
    train = Subset(data(80), perm[:64])
    records = observed(tmp_path, [DataLoader(train, batch_size=8, sampler=DistributedSampler(
        train, num_replicas=2, rank=r, seed=0)) for r in range(2)])
    assert data_coverage(records, 2, []) == []
    assert "against the 64 samples of the Subset the loader wraps" in checked(records, 2)[0]
    for recs in records.values():  # measured against the tensor under the Subset, as before
        recs[0].pop("universes")
    (f,) = data_coverage(records, 2, [])
    assert f.message == "16 of 80 samples are drawn by no rank in pass 0"


def test_the_observer_names_the_line_that_created_the_iterator(tmp_path):
    from torch.utils.data import DataLoader
    rec = observed(tmp_path, [DataLoader(data(8), batch_size=4)])[0][0]
    path, line = rec["at"].rsplit(":", 1)
    with open(path) as f:
        assert "obs.loader_pass(iter(loader), loader)" in f.read().splitlines()[int(line) - 1]


def test_a_concat_dataset_and_index_lists_are_covered_against_what_the_ranks_draw_from(tmp_path):
    from torch.utils.data import ConcatDataset, DataLoader, Subset, SubsetRandomSampler
    concat = ConcatDataset([Subset(data(40), range(20)), data(12)])
    records = observed(tmp_path / "concat", [DataLoader(concat, batch_size=4, sampler=DistributedSampler(
        concat, num_replicas=2, rank=r)) for r in range(2)])
    assert data_coverage(records, 2, []) == []
    # a hand-made split of the ConcatDataset that leaves out 2 of its 32 samples
    records = observed(tmp_path / "split", [DataLoader(Subset(concat, range(r * 15, r * 15 + 15)), batch_size=4)
                                            for r in range(2)])
    (f,) = data_coverage(records, 2, [])
    assert f.message == "2 of 32 samples are drawn by no rank in pass 0" and "never drawn: [30, 31]" in f.evidence
    # index lists: each rank its own shard of the training indices is clean; one list for all is not
    train = list(range(10, 74))
    records = observed(tmp_path / "shards", [DataLoader(data(80), batch_size=8, sampler=SubsetRandomSampler(
        train[r::2])) for r in range(2)])
    assert data_coverage(records, 2, []) == []
    records = observed(tmp_path / "same", [DataLoader(data(80), batch_size=8, sampler=SubsetRandomSampler(train))
                                           for r in range(2)])
    (f,) = data_coverage(records, 2, [])
    assert f.message.startswith("every rank draws the same 64 samples")


def test_a_subset_per_rank_is_a_shard_of_the_whole_data_set(tmp_path):
    """The ranks wrap different Subsets (a hand-made split): covered against the data set under them."""
    from torch.utils.data import DataLoader, Subset
    records = observed(tmp_path, [DataLoader(Subset(data(64), range(r * 21, r * 21 + 21)), batch_size=8)
                                  for r in range(3)])
    (f,) = data_coverage(records, 3, [])
    assert f.message == "1 of 64 samples are drawn by no rank in pass 0" and "never drawn: [63]" in f.evidence


# -- resume, fixes, lines ---------------------------------------------------------------------------

def test_a_relaunch_that_trains_from_step_1_did_not_resume():
    from ddp_lab.verify.resume import compare
    a = {n: {"params": {"w": f"after {n}"}} for n in (1, 2, 3)}
    restarted = [{**a[n], "at": "train.py:40"} for n in (1, 2, 3)]
    (f,) = compare(a, restarted, 2)
    assert (f.category, f.step, f.line) == ("resume-mismatch", 1, "train.py:40")
    assert "did not resume" in f.message and "after `--`" in f.fix
    assert compare(a, [a[2], a[3]], 2) == []
    assert compare(a, restarted, 1) == []  # killed after step 1: the relaunch has nothing to skip


def test_findings_name_the_script_line_the_observer_saw():
    (f,) = comm_per_step({0: [{**step(1, rounds=4), "round_lines": ["train.py:33"] * 4}]}, [])
    assert f.line == "train.py:33" and "line: train.py:33" in f.text()
    assert "the forward too" in f.fix and "no_sync()" in f.fix
    recs = {0: [{**step(1), "at": "train.py:35"}], 1: [{**step(1, params={"w": "b"}), "at": "train.py:35"}]}
    (f,) = replica_divergence(recs, [])
    assert f.line == "train.py:35" and f.to_dict()["line"] == "train.py:35"
    (f,) = data_coverage(passes(16, 2, set_epoch=False), 2, [])
    assert f.line is None  # records without the observer's line: none is made up


def test_a_hang_names_the_line_the_odd_rank_was_at(tmp_path):
    from ddp_lab.autopsy.diagnose import Diagnosis, RankState
    from ddp_lab.autopsy.evidence import Frame
    from ddp_lab.verify.runner import _hang

    class Hung(Exception):
        autopsy = Diagnosis("rank 0 is elsewhere", {0: RankState(0, "elsewhere", where=Frame("t.py", 18, "main")),
                                                    1: RankState(1, "waiting", where=Frame("t.py", 31, "main"))},
                            "mismatch")
    f = _hang(Hung("hung"), tmp_path, 2)
    assert (f.category, f.rank, f.line) == ("hang", 0, "t.py:18")


def test_a_clean_report_says_what_was_checked_and_what_it_cannot_rule_out():
    from ddp_lab.verify.findings import LIMITS, Finding, checked
    from ddp_lab.verify.runner import Report
    said = checked(passes(16, 2), 2)
    assert said[0].startswith("data-coverage: 2 passes of loader 0 on 2 ranks, against the 16 samples")
    assert said[1] == "replica-divergence: 1 parameter tensor bitwise on 2 ranks after 1 step"
    clean = Report("train.py", checked=said, limits=list(LIMITS)).text()
    assert "checked:\n  - data-coverage" in clean and "cannot rule out:" in clean
    assert "cannot rule out" not in Report("train.py", findings=[Finding("hang", 0, 1, "m", "e", "f")]).text()
