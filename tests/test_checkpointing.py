"""Checkpoint functions (ddp_lab.lessons.checkpointing) and notebook 06's experiment programs."""
import io
import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lab.lessons import checkpointing as ck
from ddp_lab.engine import runtime
from ddp_lab.lessons import models


def same_weights(a, b) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_prefixes_of_ddp_and_compile_are_stripped():
    torch.manual_seed(0)
    model = models.mlp()
    with runtime.distributed():  # a world of one: a real DDP wrapper
        wrapped = torch.compile(DDP(model))  # keys: _orig_mod.module.<name>
        state = wrapped.state_dict()
        assert ck.unwrap(wrapped) is model
    assert all(k.startswith("_orig_mod.module.") for k in state)
    plain = models.mlp()
    with pytest.raises(RuntimeError, match="Missing key"):
        plain.load_state_dict(state)
    plain.load_state_dict(ck.clean_state_dict(state))  # strict
    assert same_weights(plain.state_dict(), model.state_dict())
    assert list(state)[0].startswith("_orig_mod.")  # the input is left untouched


def test_checkpoint_holds_everything_and_loads_weights_only(tmp_path):
    model = models.mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt = ck.make_checkpoint(model, optimizer, step=7, epoch=1, config={"lr": 0.1})
    assert set(ck.MUST_HOLD) <= set(ckpt)
    ck.atomic_save(ckpt, tmp_path / "c.pt")
    back = torch.load(tmp_path / "c.pt", weights_only=True)
    assert back["step"] == 7 and back["config"] == {"lr": 0.1}
    assert same_weights(back["model"], model.state_dict())


def test_killed_naive_save_is_torn_and_atomic_keeps_the_previous(tmp_path):
    targets = {"naive": tmp_path / "n.pt", "atomic": tmp_path / "a.pt"}
    ck.naive_save(ck.demo_checkpoint(1, megabytes=1), targets["naive"])
    ck.atomic_save(ck.demo_checkpoint(1, megabytes=1), targets["atomic"])
    killed = ck.kill_mid_save(targets, step=2, megabytes=1)
    written, total = killed["naive"]
    assert 0 < written < total and targets["naive"].stat().st_size == written
    with pytest.raises(RuntimeError):
        torch.load(targets["naive"], weights_only=True)
    assert torch.load(targets["atomic"], weights_only=True)["step"] == 1
    assert len(ck.stale_temps(tmp_path)) == 1


def test_failed_atomic_save_leaves_old_file_and_no_temp(tmp_path):
    path = tmp_path / "last.pt"
    ck.atomic_save({"step": 1}, path)

    class Boom(io.FileIO):
        def write(self, b):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ck.atomic_save({"step": 2}, path, opener=lambda p, m: Boom(p, m))
    assert torch.load(path, weights_only=True)["step"] == 1
    assert ck.stale_temps(tmp_path) == []


def test_bad_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="naive"):
        ck.kill_mid_save({"fast": tmp_path / "x.pt"})


def test_counted_load_counts_the_file():
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(1000)}, buf)
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ddp_lab_count_{os.getpid()}.pt")
    try:
        with open(path, "wb") as f:
            f.write(buf.getvalue())
        obj, nread = ck.counted_load(path)
        assert torch.equal(obj["w"], torch.zeros(1000)) and nread >= os.path.getsize(path)
    finally:
        os.remove(path)


def test_every_checkpoint_part_matters_and_all_of_them_resume_exactly():
    from ddp_lab.lessons.checkpointing import parts as checkpoint_parts

    diffs = checkpoint_parts.leave_one_out()["max_abs_diff"]
    assert diffs.pop("nothing") == 0.0
    assert all(d > 0 for d in diffs.values()), diffs


def test_cost_model_matches_a_failure_by_failure_simulation():
    job = dict(step_s=1.0, save_s=60.0, mtbf_s=8 * 3600.0, restart_s=300.0)
    young = ck.young_interval(job["step_s"], job["save_s"], job["mtbf_s"])
    sim = {n: ck.simulate_overhead(n, **job) for n in (50, 100, round(young / 2), round(young), round(2 * young), 20000)}
    for n, s in sim.items():
        assert ck.overhead(n, **job) == pytest.approx(s, rel=0.03), n
    assert sim[round(young)] <= 1.01 * min(sim.values())
    # the first-order formula is close near Young's interval and far off when saves are frequent
    assert ck.overhead_first_order(round(young), **job) == pytest.approx(sim[round(young)], rel=0.05)
    assert ck.overhead_first_order(50, **job) > 1.5 * sim[50]


def test_simulation_counts_saved_steps_only():
    # no failures in sight: the only cost is the save, C / (N t + C)
    assert ck.simulate_overhead(10, 1.0, 5.0, mtbf_s=1e12, failures=10) == pytest.approx(5 / 15, rel=1e-6)
    # a failure every ~1 s and cycles of 11 s: almost nothing is ever saved
    assert ck.simulate_overhead(10, 1.0, 1.0, mtbf_s=1.0, failures=1000) > 0.99


def test_lost_steps():
    assert [ck.lost_steps(c, 10) for c in (27, 30, 9)] == [7, 0, 9]
