"""scripts/train_ddp.py in an elastic job: two nodes, one lost, the survivor alone, a new node
joins. Every membership change restarts the workers at the new world size; they resume from
last.pt at the same global position. The test holds training at chosen steps (tests/programs/
gated.py) so that each change happens mid-training whatever the machine's speed."""
import itertools
import json
import math
import os

from ddp_lab.engine import elastic, launch

from conftest import PROGRAMS

TRAIN, VAL, BATCH, LR = 1500, 297, 32, 0.003   # digits: training and validation samples; batch per rank


def metrics(path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def kinds(path, kind):
    return [r for r in metrics(path) if r["kind"] == kind]


def collapse(values):
    """The values without consecutive repeats."""
    return [v for v, _ in itertools.groupby(values)]


def set_gate(gate, step):
    tmp = gate.with_suffix(".tmp")
    tmp.write_text(str(step))
    os.replace(tmp, gate)                  # the ranks never read half a number


def test_train_ddp_shrinks_to_one_node_and_grows_back(tmp_path, monkeypatch):
    gate, out, ckpt = tmp_path / "gate", tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    set_gate(gate, 10)                     # hold every rank before step 11
    monkeypatch.setenv("GATE", str(gate))
    program = (f"{PROGRAMS / 'gated.py'} {launch.script('train_ddp.py')} -- --dataset digits "
               f"--optimizer adamw --lr {LR} --epochs 2 --batch-size {BATCH} --save-every 5 "
               f"--log-every 5 --ckpt-dir {ckpt} --metrics-out {out} --timeout 120 --progress off")
    saved = lambda step: any(r["step"] == step for r in kinds(out, "ckpt"))
    with elastic.Cluster(program) as c:
        c.start("A", host=True)
        c.start("B")
        c.wait(lambda _: saved(10), "step 10 saved by 2 nodes")
        c.kill("B")                        # node B is lost while both ranks wait before step 11
        set_gate(gate, 20)                 # A's rank goes on, fails at its next collective, restarts alone
        c.wait(lambda _: saved(20) and kinds(out, "config")[-1]["world_size"] == 1, "step 20 saved by 1 node")
        c.start("C")                       # a new node: A's agent restarts its worker for a world of 2
        c.wait(lambda _: [r["world_size"] for r in kinds(out, "config")][-2:] == [1, 2], "a world of 2 again")
        gate.unlink()                      # run to the end
        codes = c.wait_exit(["A", "C"])
    assert codes == {"A": 0, "C": 0}
    # (On a busy machine a round can close before a slow agent joins it: the job then restarts once
    # more at the same size, from the same checkpoint. That is the rendezvous at work, not a fault.)
    assert collapse(r["world_size"] for r in kinds(out, "config")) == [2, 1, 2]
    assert collapse(r["step"] for r in kinds(out, "resume")) == [10, 20]
    # The position is global: steps 1-10 used 10 x 2 x 32 samples, steps 11-20 on one rank 10 x 32;
    # the rest of epoch 0 is shared by two ranks again, then epoch 1 whole.
    left = TRAIN - 10 * 2 * BATCH - 10 * BATCH
    final = 20 + math.ceil(left / 2 / BATCH) + math.ceil(TRAIN / 2 / BATCH)
    assert kinds(out, "final")[-1]["step"] == final
    evals = kinds(out, "eval")
    assert [(r["epoch"], r["step"]) for r in evals] == [(0, final - math.ceil(TRAIN / 2 / BATCH)), (1, final)]
    assert all(r["count"] == VAL for r in evals) and evals[-1]["acc"] > 0.7
    # The cosine schedule follows the data: the last step ran at the rate of an uninterrupted
    # 2-rank run's last step (index 47 of 48), not past the schedule's end (a rate of 0).
    total = 2 * math.ceil(TRAIN / 2 / BATCH)
    last = kinds(out, "train")[-1]
    assert last["step"] == final
    assert math.isclose(last["lr"], LR * 0.5 * (1 + math.cos(math.pi * (total - 1) / total)), rel_tol=1e-9)
