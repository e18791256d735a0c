"""`ddp-lab grade`: which graded exercises pass, per notebook, from the grades file."""
from __future__ import annotations

import json
import sys

DESCRIPTION = ("Print, per notebook, which graded exercises pass (✓), were tried (✗), could not be judged on\n"
               "this machine (⊘ blocked: it needs CUDA, or more cores than ranks for a timing) or not yet (·).\n"
               "Verdicts come from grade.check in the notebooks, kept in ~/.ddp_lab/grades.json\n"
               "(DDP_LAB_GRADES=/path/grades.json names another file).")


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print {notebook: {exercise: passed | tried | blocked | not attempted}} as JSON")


def run(args) -> int:
    from ddp_lab import grade
    from ddp_lab.grade import store
    try:
        if args.json:
            print(json.dumps(store.table(), indent=1))
        else:
            grade.progress()
    except RuntimeError as err:  # an unreadable grades file: say which and what to do, touch nothing
        print(f"ddp-lab grade: {err}", file=sys.stderr)
        return 2
    return 0
