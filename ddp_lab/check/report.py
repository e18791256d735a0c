"""`ddp-lab check` / `python -m ddp_lab.check`: arguments, text and JSON output, exit codes."""
from __future__ import annotations

import argparse
import json
import sys
import textwrap

from . import RULES, check_paths

DESCRIPTION = "Find the classic DDP bugs in training scripts, launch scripts and notebooks (static: nothing runs)."
EPILOG = """exit status: 0 nothing found, 1 findings, 2 a path could not be read or parsed.
silence one finding with a comment on its line:  # ddp-lab: ignore[DDP010]
every rule, with an example: ddp-lab check --list-rules, or docs/check.md"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="*", default=["."], metavar="PATH",
                   help="files (.py, .sh, .sbatch, .ipynb) or folders to check (default: .)")
    p.add_argument("--format", choices=["text", "json"], default="text", help="output format (default text)")
    p.add_argument("--select", default="", metavar="IDS", help="only these rules, e.g. DDP010,DDP013")
    p.add_argument("--ignore", default="", metavar="IDS", help="skip these rules, e.g. DDP002")
    p.add_argument("--concise", action="store_true", help="one line per finding (no fix and notebook lines)")
    p.add_argument("--list-rules", action="store_true", help="print every rule and exit")


def _ids(text: str) -> list[str]:
    ids = [s.strip().upper() for s in text.split(",") if s.strip()]
    unknown = [i for i in ids if i not in RULES]
    if unknown:
        raise SystemExit(f"ddp-lab check: unknown rule id(s): {', '.join(unknown)} (see --list-rules)")
    return ids


def list_rules(out=None) -> None:
    out = out or sys.stdout
    for r in sorted(RULES.values(), key=lambda r: r.id):
        print(f"{r.id}  [{r.kind}] {r.sentence}", file=out)
        print(textwrap.indent(f"fix: {r.fix}\nsee: {r.see}", "       "), file=out)


def run(args: argparse.Namespace, out=None, err=None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    if args.list_rules:
        list_rules(out)
        return 0
    try:
        select, ignore = _ids(args.select), _ids(args.ignore)
    except SystemExit as e:
        print(e, file=err)
        return 2
    findings, errors, checked = check_paths(args.paths, select or None, ignore)
    if args.format == "json":
        json.dump({"findings": [f.to_dict() for f in findings], "errors": [{"path": p, "message": m} for p, m in errors],
                   "files_checked": checked}, out, indent=2, ensure_ascii=False)
        print(file=out)
    else:
        for f in findings:
            print(f"{f.location()}: {f.id} {f.message}", file=out)
            if not args.concise:
                print(f"    fix: {f.fix}\n    see: {f.see}", file=out)
        for path, message in errors:
            print(f"{path}: error: {message}", file=err)
        files = len({f.path for f in findings})
        summary = (f"{len(findings)} finding{'s' * (len(findings) != 1)} in {files} file{'s' * (files != 1)}"
                   if findings else "no DDP problems found")
        print(f"{summary} ({checked} file{'s' * (checked != 1)} checked)", file=out)
    return 2 if errors else 1 if findings else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddp_lab.check", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))
