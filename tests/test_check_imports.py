"""ddp_lab.check follows imports between the files it checks together: a bug whose parts sit in a
project's helper file is reported in the calling file, at the call where the fix goes. Each test
writes a small project in the shapes of real ones (Swin's loss scaler, DINO's and MAE's utils)."""
import textwrap

import pytest

from ddp_lab import check

HEAD = """\
import datetime
import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
"""

UTILS = HEAD + """\


def is_main_process():
    return dist.get_rank() == 0


def save_on_master(*args, **kwargs):
    if is_main_process():
        torch.save(*args, **kwargs)


def save_checkpoint(state, path):
    torch.save(state, path)


def fix_random_seeds(seed=31):
    torch.manual_seed(seed)


def evaluate(model, loader):
    correct = torch.zeros(2)
    for x, y in loader:
        correct += torch.tensor([float((model(x).argmax(1) == y).sum()), float(len(y))])
    dist.all_reduce(correct)
    return correct[0] / correct[1]


def evaluate_here(model, loader):
    return sum(float((model(x).argmax(1) == y).sum()) for x, y in loader)


class NativeScalerWithGradNormCount:
    def __init__(self):
        self._scaler = torch.amp.GradScaler("cuda")

    def __call__(self, loss, optimizer, update_grad=True):
        self._scaler.scale(loss).backward()
        if update_grad:
            self._scaler.step(optimizer)
            self._scaler.update()
"""

MAIN = HEAD + """\
import utils
from utils import NativeScalerWithGradNormCount, fix_random_seeds, save_checkpoint


def train_one_epoch(model, loader, optimizer, loss_scaler, accum_steps):
    for idx, (x, y) in enumerate(loader):
        loss = torch.nn.functional.cross_entropy(model(x), y) / accum_steps
        loss_scaler(loss, optimizer, update_grad=(idx + 1) % accum_steps == 0)
        if (idx + 1) % accum_steps == 0:
            optimizer.zero_grad()


def main(args):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    fix_random_seeds(args.seed + rank)
    model = torch.nn.Linear(4, 2)
    model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_scaler = NativeScalerWithGradNormCount()
    for epoch in range(args.epochs):
        train_one_epoch(model, args.loader, optimizer, loss_scaler, args.accum_steps)
        save_checkpoint({"model": model.module.state_dict()}, "checkpoint.pth")
        if utils.is_main_process():
            acc = utils.evaluate(model, args.val_loader)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
"""

# Each helper's correct look-alike, and the one change in main.py that calls it instead.
LOOK_ALIKES = [
    ("DDP010", "accumulation under no_sync",
     "        loss_scaler(loss, optimizer, update_grad=(idx + 1) % accum_steps == 0)\n",
     "        last = (idx + 1) % accum_steps == 0\n"
     "        with (model.no_sync() if not last else torch.enable_grad()):\n"
     "            loss_scaler(loss, optimizer, update_grad=last)\n"),
    ("DDP006", "a seed helper called with a constant seed", "fix_random_seeds(args.seed + rank)",
     "fix_random_seeds(args.seed)"),
    ("DDP013", "save_on_master, which checks the rank", "save_checkpoint({", "utils.save_on_master({"),
    ("DDP009", "an evaluate without collectives", "utils.evaluate(", "utils.evaluate_here("),
]

# (rule, text on the line of main.py it must point at, text on the line of utils.py the message names)
CROSS_FILE = [
    ("DDP010", "loss_scaler(loss, optimizer, update_grad", "self._scaler.scale(loss).backward()"),
    ("DDP006", "fix_random_seeds(args.seed + rank)", None),
    ("DDP013", 'save_checkpoint({"model"', "torch.save(state, path)"),
    ("DDP009", "acc = utils.evaluate(model", "dist.all_reduce(correct)"),
]


def line_of(text: str, snippet: str) -> int:
    assert text.count(snippet) == 1, f"{snippet!r} must occur exactly once"
    return text[:text.index(snippet)].count("\n") + 1


def write(folder, files: dict):
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return folder


def found(paths, **kw):
    findings, errors, _ = check.check_paths([str(p) for p in paths], **kw)
    assert errors == []
    return findings


@pytest.fixture
def project(tmp_path):
    return write(tmp_path, {"main.py": MAIN, "utils.py": UTILS})


@pytest.mark.parametrize("rule, snippet, helper_line", CROSS_FILE, ids=[c[0] for c in CROSS_FILE])
def test_a_bug_in_a_helper_of_another_file_is_found_at_its_call(project, rule, snippet, helper_line):
    [f] = [f for f in found([project], select=[rule]) if f.path.endswith("main.py")]
    assert f.line == line_of(MAIN, snippet)
    if helper_line is not None:
        assert f"utils.py line {line_of(UTILS, helper_line)}" in f.message


def test_the_whole_project_reports_exactly_those_findings(project):
    assert sorted((f.path.rsplit("/", 1)[-1], f.line, f.id) for f in found([project])) == \
        sorted(("main.py", line_of(MAIN, snippet), rule) for rule, snippet, _ in CROSS_FILE)


@pytest.mark.parametrize("rule, case, old, new", LOOK_ALIKES, ids=[c[1] for c in LOOK_ALIKES])
def test_a_correct_look_alike_is_quiet(tmp_path, rule, case, old, new):
    # the helper is correct (or correctly called): its finding goes, the other three stay
    assert MAIN.count(old) == 1
    write(tmp_path, {"main.py": MAIN.replace(old, new), "utils.py": UTILS})
    assert sorted(f.id for f in found([tmp_path])) == sorted(r for r, _, _ in CROSS_FILE if r != rule)


def test_a_file_checked_alone_is_judged_as_before(project):
    # nothing of utils.py is known: the helpers are not followed, so none of these is found
    main = project / "main.py"
    assert found([main]) == [] and check.check_file(main) == []
    assert [f.id for f in found([main, project / "utils.py"])] == [r for r, _, _ in sorted(
        CROSS_FILE, key=lambda c: line_of(MAIN, c[1]))]


def test_only_the_files_checked_are_followed(project):
    # utils.py sits beside main.py but is not among the files checked: it is never read
    other = write(project / "other", {"other.py": "import torch\n"})
    assert found([project / "main.py", other / "other.py"]) == []
    assert len(found([project / "main.py", other / "other.py", project / "utils.py"])) == len(CROSS_FILE)


def test_each_file_is_parsed_once(project, monkeypatch):
    reads = []
    real = check.read_python
    monkeypatch.setattr(check, "read_python", lambda path: reads.append(str(path)) or real(path))
    assert len(found([project])) == len(CROSS_FILE)
    assert sorted(reads) == sorted(str(project / n) for n in ("main.py", "utils.py"))


EVAL_UNDER_MAIN = """\
def run(model, loader):
    if is_main_process():
        acc = {call}(model, loader)
"""
IMPORT_FORMS = [
    ("import x as y; y.f()", "app/train.py", "import helpers as h\n", "h.evaluate", {"app/helpers.py"}),
    ("from x import f", "app/train.py", "from helpers import evaluate\n", "evaluate", {"app/helpers.py"}),
    ("from .x import f", "pkg/train.py", "from .helpers import evaluate\n", "evaluate", {"pkg/helpers.py"}),
    ("from ..x import f", "pkg/sub/train.py", "from ..helpers import evaluate\n", "evaluate", {"pkg/helpers.py"}),
    ("from pkg.x import f", "pkg/train.py", "from pkg.helpers import evaluate\n", "evaluate", {"pkg/helpers.py"}),
    ("import pkg.x; pkg.x.f()", "pkg/train.py", "import pkg.helpers\n", "pkg.helpers.evaluate", {"pkg/helpers.py"}),
    ("from pkg import x; x.f()", "pkg/train.py", "from pkg import helpers\n", "helpers.evaluate", {"pkg/helpers.py"}),
    ("re-exported by __init__.py", "app/train.py", "from pkg import evaluate\n", "evaluate",
     {"app/pkg/helpers.py", "app/pkg/__init__.py"}),
]
HELPERS = HEAD + "\n\ndef evaluate(model, loader):\n    total = torch.zeros(1)\n    dist.all_reduce(total)\n" \
    "    return total\n"


@pytest.mark.parametrize("form, caller, imports, call, helpers", IMPORT_FORMS, ids=[f[0] for f in IMPORT_FORMS])
def test_each_import_form_is_followed(tmp_path, form, caller, imports, call, helpers):
    main = HEAD + imports + "from dist_utils import is_main_process\n\n\n" + EVAL_UNDER_MAIN.format(call=call)
    files = {caller: main, **{h: HELPERS if h.endswith("helpers.py") else "from .helpers import evaluate\n"
                              for h in helpers}}
    for package in {p for h in files for p in [h.rsplit("/", 1)[0]] if p.startswith("pkg")}:
        files.setdefault(f"{package}/__init__.py", "")
    write(tmp_path, files)
    found_here = [(f.line, f.id) for f in found([tmp_path]) if f.path.endswith(caller.split("/")[-1])]
    assert found_here == [(line_of(main, f"acc = {call}("), "DDP009")]


def test_a_same_named_helper_that_is_not_imported_is_not_followed(tmp_path):
    # train.py calls its own evaluate (no collective); helpers.evaluate all-reduces but is not the one called
    imported = HEAD + "from helpers import evaluate\nfrom dist_utils import is_main_process\n\n\n" + \
        EVAL_UNDER_MAIN.format(call="evaluate")
    write(tmp_path, {"train.py": imported, "helpers.py": HELPERS})
    assert [f.id for f in found([tmp_path])] == ["DDP009"]
    own = imported.replace("from helpers import evaluate\n", "").replace(
        "\n\ndef run", "\n\ndef evaluate(model, loader):\n    return 0.0\n\n\ndef run")
    write(tmp_path, {"train.py": own})
    assert found([tmp_path]) == []


SEED_AT_MODULE_LEVEL = HEAD + """\
import random


def main(args):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
{reseed}    model = torch.nn.Linear(4, 2)
    model = DDP(model)


if __name__ == "__main__":
    args = parse_args()
    seed = args.seed + int(os.environ["RANK"])
    torch.manual_seed(seed)
    random.seed(seed)
    main(args)
"""


def test_a_per_rank_seed_at_module_level_before_main_builds_the_model():
    code = SEED_AT_MODULE_LEVEL.format(reseed="")
    found = check.source(code, select=["DDP006"])
    # one seed set by two calls: one finding, on the first, naming the other and the build in main()
    assert [(f.line, f.id) for f in found] == [(line_of(code, "torch.manual_seed(seed)"), "DDP006")]
    assert f"also set on line {line_of(code, 'random.seed(seed)')})" in found[0].message
    assert f"before the model is built (line {line_of(code, 'model = torch.nn.Linear')})" in found[0].message


def test_a_module_level_seed_that_main_replaces_before_building_is_quiet():
    reseeded = SEED_AT_MODULE_LEVEL.format(reseed="    torch.manual_seed(args.seed)\n")
    same_everywhere = SEED_AT_MODULE_LEVEL.format(reseed="").replace(' + int(os.environ["RANK"])', "")
    assert [len(check.source(code, select=["DDP006"])) for code in (
        SEED_AT_MODULE_LEVEL.format(reseed=""), reseeded, same_everywhere)] == [1, 0, 0]
