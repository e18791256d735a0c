"""The `ddp-lab` command: tools you run on your own work, one subcommand each.

    ddp-lab check train.py launch.sh     # static checker for the classic DDP bugs
    ddp-lab doctor [--json]              # pre-flight checklist of this machine (runs an all-reduce)
    ddp-lab autopsy DIR [--json]         # why a job hung, from its ranks' dumps
    ddp-lab verify -- train.py [ARGS]    # run your script on CPU ranks: is it DDP-correct?
    ddp-lab grade [--json]               # which graded exercises pass, per notebook

A subcommand is a module with add_arguments(parser) and run(args) -> exit status; add one
by listing it in SUBCOMMANDS.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with add_arguments(parser) and run(args), one-line help)
SUBCOMMANDS = {
    "check": ("ddp_lab.check.report", "find the classic DDP bugs in scripts and notebooks (nothing runs)"),
    "doctor": ("ddp_lab.doctor", "check this machine before a DDP job: versions, GPUs, a real all-reduce, limits"),
    "autopsy": ("ddp_lab.autopsy.command", "explain a hung job from its ranks' dumps: who waits where, who never came"),
    "verify": ("ddp_lab.verify.command", "run your script on CPU ranks and check data shards, replicas, all-reduces"),
    "grade": ("ddp_lab.grade.command", "show which graded exercises of the notebooks pass"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddp-lab", description="DDP Lab tools for your own training code.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        sp = sub.add_parser(name, help=help_text, description=getattr(mod, "DESCRIPTION", help_text),
                            epilog=getattr(mod, "EPILOG", None), formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(sp)
        sp.set_defaults(run=mod.run)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
