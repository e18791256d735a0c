"""`ddp-lab autopsy DIR`: the launcher's hang diagnosis for a job run without it."""
from __future__ import annotations

import json
import os
import sys

DESCRIPTION = """\
Explain a hung or timed-out DDP job from what its ranks left in DIR: Flight Recorder dumps
(TORCH_FR_DUMP_TEMP_FILE-style files, one per rank: nccl_trace_rank_0, fr_trace_rank_1, ...),
the stacks and dumps ddp_lab's launcher writes (rank0.request.json, rank1.sigterm.txt, ...) and
torchrun's @record error files (error.json). Prints which rank waits in which collective, which
rank never reached it and where it was, and the known cause when it recognises one."""

EPILOG = """\
Enable the dumps on a real job (docs/autopsy.md):
  NCCL:  TORCH_FR_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_FR_DUMP_TEMP_FILE=$DIR/nccl_trace_rank_
  gloo:  TORCH_FR_BUFFER_SIZE=2000 DDP_LAB_AUTOPSY_DIR=$DIR PYTHONPATH=$(python -c "import ddp_lab.autopsy.collect as c; print(c.INJECT)"):$PYTHONPATH

exit status: 0 a diagnosis was printed, 1 nothing in DIR explains a hang, 2 DIR is not a folder
(the same when the reader closes the pipe early, as `| head` does: the output stops quietly)"""


def add_arguments(p) -> None:
    p.add_argument("dir", metavar="DIR", help="folder holding the per-rank dumps (searched recursively)")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="ranks in the job, so that a rank which left nothing is named too")


def run(args) -> int:
    from ddp_lab.autopsy.diagnose import diagnose_folder
    if not os.path.isdir(args.dir):
        _say(f"ddp-lab autopsy: {args.dir} is not a folder")
        return 2
    d = diagnose_folder(args.dir, args.world_size)
    if d is None:
        if args.json:
            _say(json.dumps({"headline": None, "folder": args.dir}))
        else:
            _say(f"ddp-lab autopsy: nothing in {args.dir} shows where the ranks were (no Flight Recorder "
                 f"dump, stack or error file); see `ddp-lab autopsy --help` for how to enable them")
        return 1
    _say(json.dumps(d.to_dict(), indent=2) if args.json else d.message())
    return 0


def _say(text: str) -> None:
    """Print text; a reader that closed the pipe (`| head`) ends the output without a traceback."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # Python would flush again at exit and print the error there: point stdout at /dev/null
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
