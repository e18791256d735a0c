"""`ddp-lab check` / `python -m ddp_lab.check`: arguments, text, JSON and SARIF output, --fix, exit codes."""
from __future__ import annotations

import argparse
import json
import sys
import textwrap

from . import RULES, check_paths, fix, sarif

DESCRIPTION = "Find the classic DDP bugs in training scripts, launch scripts and notebooks (static: nothing runs)."
EPILOG = """exit status: 0 nothing found, 1 findings, 2 a path could not be read, parsed or analysed (the other
files' findings are still printed), or no file was checked. --format json/sarif always print their document.
--fix prints the safe rewrites as a diff; --fix --write applies them (then 1 only if findings remain).
silence one finding with a comment on its line:  # ddp-lab: ignore[DDP010]
every rule, with an example: ddp-lab check --list-rules, or docs/check.md"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="*", default=["."], metavar="PATH",
                   help="files (.py, .sh, .sbatch, .ipynb) or folders to check (default: .)")
    p.add_argument("--format", choices=["text", "json", "sarif"], default="text",
                   help="output format (default text; sarif: SARIF 2.1.0 for GitHub code scanning)")
    p.add_argument("--select", default="", metavar="IDS", help="only these rules, e.g. DDP010,DDP013")
    p.add_argument("--ignore", default="", metavar="IDS", help="skip these rules, e.g. DDP002")
    p.add_argument("--concise", action="store_true", help="one line per finding (no fix and notebook lines)")
    p.add_argument("--list-rules", action="store_true", help="print every rule and exit")
    p.add_argument("--fix", action="store_true",
                   help=f"print the safe rewrites ({', '.join(sorted(FIXABLE))}) as a unified diff; nothing is written")
    p.add_argument("--write", action="store_true", help="with --fix: apply the rewrites to the files")


FIXABLE = {*fix.PYTHON_FIXERS, "DDP101"}


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
        if args.write and not args.fix:
            raise SystemExit("ddp-lab check: --write applies the rewrites of --fix: use --fix --write")
        if args.fix and args.format != "text":
            raise SystemExit("ddp-lab check: --fix prints a diff: use it without --format")
    except SystemExit as e:
        print(e, file=err)
        return 2
    findings, errors, checked = check_paths(args.paths, select or None, ignore)
    if args.fix and checked:
        return _fix(findings, errors, args, out, err)
    nothing = None if checked else _nothing_checked(args.paths, errors)
    # JSON and SARIF are always printed (CI reads them), with every file that could not be checked
    listed = [(", ".join(map(str, args.paths)), nothing)] if nothing and not errors else errors
    if args.format == "sarif":
        from .. import __version__
        json.dump(sarif.document(findings, listed, __version__), out, indent=2, ensure_ascii=False)
        print(file=out)
    elif args.format == "json":
        json.dump({"findings": [f.to_dict() for f in findings], "errors": [{"path": p, "message": m} for p, m in listed],
                   "files_checked": checked}, out, indent=2, ensure_ascii=False)
        print(file=out)
    _text(findings if args.format == "text" else [], errors, args.concise, out, err)
    if nothing:
        print(f"ddp-lab check: {nothing}", file=err)
        return 2
    if args.format == "text":
        files = len({f.path for f in findings})
        summary = (f"{len(findings)} finding{'s' * (len(findings) != 1)} in {files} file{'s' * (files != 1)}"
                   if findings else "no DDP problems found")
        print(f"{summary} ({checked} file{'s' * (checked != 1)} checked)", file=out)
    return 2 if errors else 1 if findings else 0


def _nothing_checked(paths, errors) -> str:
    """One line: why no file was checked."""
    if errors:
        n = len(errors)
        return f"no file was checked: {'the path' if n == 1 else f'all {n} paths'} could not be read or parsed (see above)"
    return (f"no file was checked: {', '.join(map(str, paths))} holds no .py, .sh, .sbatch or .ipynb file; "
            "name the files or the folder that holds them")


def _text(findings, errors, concise: bool, out, err) -> None:
    for f in findings:
        print(f"{f.location()}: {f.id} {f.message}", file=out)
        if not concise:
            print(f"    fix: {f.fix}\n    see: {f.see}", file=out)
    for path, message in errors:
        print(f"{path}: error: {message}", file=err)


def _fix(findings, errors, args, out, err) -> int:
    """--fix: the diff of every safe rewrite; with --write, the files rewritten. The findings left
    (no safe rewrite) are listed after the diff."""
    plans, not_fixed = fix.plan(findings)
    for p in plans:
        out.write(fix.diff(p))
        if args.write:
            fix.write(p)
    fixed = {id(f) for p in plans for f in p.fixed}
    left = [f for f in findings if id(f) not in fixed]
    _text(left, errors + not_fixed, args.concise, out, err)
    n = len(fixed)
    done = f"{'fixed' if args.write else 'can fix'} {n} finding{'s' * (n != 1)} in {len(plans)} file{'s' * (len(plans) != 1)}"
    hint = "" if args.write or not n else " (run with --fix --write to apply)"
    print(f"{done}{hint}; {len(left)} left to fix by hand", file=out)
    return 2 if errors or not_fixed else 1 if left or (n and not args.write) else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddp_lab.check", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))
