"""ddp_lab.check rules DDP021-DDP023: an averaged model updated on rank 0 only, gradients clipped
inside no_sync, an early stop decided on one rank. Short snippets (broken code marked `# <-`, and
correct look-alikes), then whole programs in tests/check_corpus/new_classes/: each `<name>.py` has
its bugs on known lines, and `<name>_clean.py` is the same program written correctly. Pure AST."""
from pathlib import Path

import pytest

from ddp_lab import check
from test_check_rules import HEAD, _cases, lines, marked  # the same harness as the older rules

NEW_CLASSES = Path(__file__).resolve().parent / "check_corpus" / "new_classes"
LOOP = "for x, y in loader:\n    model(x).sum().backward()\n    optimizer.step()\n"

BROKEN = {
    "DDP021": [
        "rank = dist.get_rank()\nmodel = DDP(net)\nema = ModelEMA(net)\n" + LOOP +
        "    if rank == 0:\n        ema.update(model.module)  # <-\nacc = evaluate(ema.ema, val_loader)",
        "model = DDP(net)\nswa_model = AveragedModel(net)\nfor epoch in range(9):\n"
        "    if dist.get_rank() == 0 and epoch > 5:\n        swa_model.update_parameters(net)  # <-\n"
        "    out = swa_model(x)\n",
        "model = DDP(net)\nfor step in range(9):\n    if is_main:\n"
        "        for p_ema, p in zip(ema_model.parameters(), net.parameters()):  # <-\n"
        "            p_ema.mul_(0.99).add_(p, alpha=0.01)\ntorch.save(ema_model.state_dict(), 'ema.pt')",
        "class Trainer:\n    def step(self):\n        if self.rank == 0:\n"
        "            self.model_ema.update(self.model)  # <-\n"
        "    def validate(self):\n        return run_validation(self.model_ema, self.val_loader)",
    ],
    "DDP022": [
        "model = DDP(net)\nfor x, y in loader:\n    with model.no_sync():\n        model(x).sum().backward()\n"
        "        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # <-\n"
        "    model(x).sum().backward()\n    optimizer.step()",
        "from torch.nn.utils import clip_grad_value_\nmodel = DDP(net)\ndef micro(x):\n"
        "    model(x).sum().backward()\n    clip_grad_value_(model.parameters(), 0.5)\nfor i, x in enumerate(loader):\n"
        "    with model.no_sync() if i % 4 else contextlib.nullcontext():\n        micro(x)  # <-\n"
        "    if i % 4 == 0:\n        optimizer.step()",
        "model = DDP(net)\nfor i, x in enumerate(loader):\n"
        "    ctx = model.no_sync() if (i + 1) % k else nullcontext()\n"
        "    with ctx:\n        model(x).sum().backward()\n"
        "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # <-\n"
        "    if (i + 1) % k == 0:\n        optimizer.step()\n        optimizer.zero_grad()",
    ],
    "DDP023": [
        "model = DDP(net)\nrank = dist.get_rank()\nfor epoch in range(99):\n    for x, y in loader:\n"
        "        model(x).sum().backward()\n    if rank == 0 and evaluate(model) < 0.1:\n        break  # <-",
        "model = DDP(net)\nbad = 0\nwhile True:\n    train_one_epoch()\n    model(x).sum().backward()\n"
        "    if dist.get_rank() == 0:\n        bad = bad + 1 if worse() else 0\n"
        "    if bad > 3:\n        break  # <-",
        "def fit(model):\n    for epoch in range(9):\n        model(x).sum().backward()\n"
        "        if local_rank == 0:\n            if early_stopper.should_stop():\n                return epoch  # <-",
        "model = DDP(net)\nfor epoch in range(9):\n    dist.all_reduce(t)\n"
        "    if not is_master:\n        break  # <-",
    ],
}

LOOKALIKES = {
    "DDP021": [
        # updated on every rank: the DDP parameters are equal, so every copy is the same
        "model = DDP(net)\nema = ModelEMA(net)\n" + LOOP +
        "    ema.update(model.module)\nacc = evaluate(ema.ema, val_loader)",
        # updated, evaluated and saved on rank 0 only: harmless
        "rank = dist.get_rank()\nmodel = DDP(net)\n" + LOOP + "    if rank == 0:\n        ema.update(model.module)\n"
        "if rank == 0:\n    print(evaluate(ema.ema, val_loader))\n    torch.save(ema.state_dict(), 'ema.pt')",
        # created on rank 0 only (YOLO): the other ranks hold no EMA at all
        "model = DDP(net)\nema = ModelEMA(net) if RANK in {-1, 0} else None\nif ema:\n    ema.update(model)",
        # not an averaged model: a meter, a dict
        "model = DDP(net)\nif rank == 0:\n    meter.update(loss.item())\n    cfg.update(lr=0.1)\nprint(meter(x))",
        # saved through helpers that write on rank 0 only
        "model = DDP(net)\nif rank == 0:\n    ema.update(model)\nsave_on_master({'ema': ema.state_dict()}, 'c.pt')\n"
        "accelerator.save(ema.state_dict(), 'e.pt')",
    ],
    "DDP022": [
        # clipped after the last micro-batch's all-reduce, before the step
        "model = DDP(net)\nfor i, x in enumerate(loader):\n    if (i + 1) % k:\n        with model.no_sync():\n"
        "            model(x).sum().backward()\n        continue\n    model(x).sum().backward()\n"
        "    scaler.unscale_(optimizer)\n    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "    optimizer.step()",
        # local SGD: the step runs inside no_sync too, so local clipping is what it means
        "model = DDP(net)\nwith model.no_sync():\n    for x in loader:\n        model(x).sum().backward()\n"
        "        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "        optimizer.step()\naverage_weights(model)",
        # no accumulation: every backward all-reduces, clip before every step
        "model = DDP(net)\nfor x in loader:\n    model(x).sum().backward()\n"
        "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n    optimizer.step()",
        # the clip inside the window
        "model = DDP(net)\nfor i, x in enumerate(loader):\n"
        "    ctx = model.no_sync() if (i + 1) % k else nullcontext()\n"
        "    with ctx:\n        model(x).sum().backward()\n    if (i + 1) % k == 0:\n"
        "        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n        optimizer.step()",
    ],
    "DDP023": [
        # decided on rank 0, broadcast, every rank breaks
        "model = DDP(net)\nfor epoch in range(9):\n    model(x).sum().backward()\n    stop = torch.zeros(1)\n"
        "    if dist.get_rank() == 0:\n        stop[0] = float(worse())\n    dist.broadcast(stop, src=0)\n"
        "    if stop.item():\n        break",
        # a flag all-reduced with MAX
        "model = DDP(net)\nfor epoch in range(9):\n    model(x).sum().backward()\n"
        "    flag = torch.tensor(float(local_stop()))\n"
        "    dist.all_reduce(flag, op=dist.ReduceOp.MAX)\n    if flag.item() > 0:\n        break",
        # the same step count on every rank
        "model = DDP(net)\nfor step, x in enumerate(loader):\n"
        "    model(x).sum().backward()\n    if step >= max_steps:\n"
        "        break",
        # rank 0 leaves a loop that runs no collective (logging)
        "model = DDP(net)\nfor name, p in model.named_parameters():\n    if rank != 0:\n        break\n    print(name)",
        # tensor.gather is not a collective, and this loop runs no backward
        "model = DDP(net)\nfor x, t in loader:\n    picked = model(x).gather(1, t)\n"
        "    if rank == 0 and picked.sum() > 3:\n"
        "        break",
        # a patience counter every rank updates from an all-reduced loss
        "model = DDP(net)\nbad = 0\nfor epoch in range(9):\n    model(x).sum().backward()\n    val = evaluate(model)\n"
        "    dist.all_reduce(val)\n    bad = bad + 1 if val > best else 0\n    if bad > 3:\n        break",
    ],
}

# file -> [(rule, text on the line it must point at)], as in test_check_styles.py
PLANTED = {
    "ema_eval_all_ranks.py": [("DDP021", "                model_ema.update(model.module)")],
    "swa_saved_every_rank.py": [("DDP021", "for p_ema, p in zip(ema_net.parameters(), net.parameters()):"),
                                ("DDP021", "            swa_model.update_parameters(net)")],
    "clip_in_no_sync.py": [("DDP022", "                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)")],
    "clip_every_micro_step.py": [("DDP022", "torch.nn.utils.clip_grad_value_(self.model.parameters(), self.clip)")],
    "early_stop_rank0.py": [("DDP023", "        if bad_epochs >= patience:\n            break"),
                            ("DDP023", "val_loss > 10 * best:\n            break")],
    "early_stop_local_loss.py": [("DDP023", "            return epoch")],
}


@pytest.mark.parametrize("rule, code", _cases(BROKEN))
def test_python_rule_flags_broken_code(rule, code):
    assert lines(HEAD + code, rule) == [n + 4 for n in marked(code)]


@pytest.mark.parametrize("rule, code", _cases(LOOKALIKES))
def test_python_rule_leaves_correct_lookalikes_alone(rule, code):
    assert lines(HEAD + code, rule) == []


def test_quiet_in_one_process_and_in_a_notebook_kernel():
    ema = "if rank == 0:\n    ema.update(net)\nacc = evaluate(ema, loader)"
    stop = "for x in loader:\n    net(x).sum().backward()\n    if rank == 0 and done():\n        break"
    for code, rule in ((ema, "DDP021"), (stop, "DDP023")):
        assert lines("import torch\n" + code, rule) == []                       # no DDP: one process
        assert [f.id for f in check.source(HEAD + code, "cell")] == []          # the kernel is one process
        assert lines(HEAD + "model = DDP(net)\n" + code, rule) != []            # the same code in a DDP program


def line_of(text: str, snippet: str) -> int:
    assert text.count(snippet) == 1, f"{snippet!r} must occur exactly once"
    return text[:text.index(snippet)].count("\n") + 1 + snippet.count("\n")


def planted(name: str) -> set:
    text = (NEW_CLASSES / name).read_text(encoding="utf-8")
    return {(line_of(text, snippet), rule) for rule, snippet in PLANTED[name]}


def clean_twin(name: str) -> str:
    return name.replace(".py", "_clean.py")


def test_every_corpus_file_is_covered_and_has_a_clean_twin():
    on_disk = {p.name for p in NEW_CLASSES.iterdir() if p.is_file()}
    assert on_disk == set(PLANTED) | {clean_twin(n) for n in PLANTED}
    assert {rule for pairs in PLANTED.values() for rule, _ in pairs} == {"DDP021", "DDP022", "DDP023"}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_bugs_and_nothing_else_are_reported(name):
    assert {(f.line, f.id) for f in check.check_file(NEW_CLASSES / name)} == planted(name)


@pytest.mark.parametrize("name", sorted(clean_twin(n) for n in PLANTED))
def test_the_clean_twin_reports_nothing(name):
    assert [f"{f.location()}: {f.id} {f.message}" for f in check.check_file(NEW_CLASSES / name)] == []


def test_messages_say_what_goes_wrong_and_fixes_say_what_to_write():
    ema, clip, every, stop = (check.check_file(NEW_CLASSES / name)[0] for name in (
        "ema_eval_all_ranks.py", "clip_in_no_sync.py", "clip_every_micro_step.py", "early_stop_local_loss.py"))
    assert ema.message.startswith("model_ema is updated only on rank 0, under `if rank == 0:` (line 43), but line 45 "
                                  "evaluates it on every rank: the other ranks hold its initial weights")
    assert "update the average on every rank" in ema.fix
    assert "partial, not yet all-reduced" in clip.message and "own norm" in clip.message
    assert "runs on every micro-step" in every.message and "`if sync:`, line 23" in every.message
    assert "after the last micro-batch's backward" in clip.fix and "scaler.unscale_(optimizer)" in clip.fix
    assert "this rank's own result of evaluate() (line 30)" in stop.message
    assert "wait there until the timeout" in stop.message and "backward()'s all-reduce" in stop.message
    assert "broadcast the decision" in stop.fix and "break on every rank together" in stop.fix
    found = check.check_file(NEW_CLASSES / "early_stop_rank0.py")
    assert sorted(f.message.split(" holds, ")[1].split(":")[0] for f in found) == [
        "decided from bad_epochs, which only rank 0 changes (line 37)", "true on rank 0 only"]


def test_the_message_says_on_which_ranks_the_break_is_taken():
    def why(code):
        return [f.message.split(" holds, ")[1].split(":")[0] for f in check.source(HEAD + code) if f.id == "DDP023"]
    loop = "model = DDP(net)\nfor x in loader:\n    model(x).sum().backward()\n    if {}:\n        break"
    assert why(loop.format("not is_master")) == ["true on every rank but rank 0"]
    assert why(loop.format("local_rank == 0 and done()")) == ["true on local rank 0 (one process per node) only"]


def test_each_rule_points_at_an_existing_lesson_section():
    sections = {r: check.RULES[r].section for r in ("DDP021", "DDP022", "DDP023")}
    assert sections == {"DDP021": "divergence", "DDP022": "no_sync", "DDP023": "skipped"}
    assert all(check.RULES[r].see.startswith("notebooks/") for r in sections)


def test_none_of_the_three_is_rewritten_by_fix():
    from ddp_lab.check import fix   # no rewrite is right everywhere: the findings are left for a hand
    findings = [f for name in PLANTED for f in check.check_file(NEW_CLASSES / name)]
    assert len(findings) == 8
    assert fix.plan(findings) == ([], [])
