"""Shell scripts, .sbatch files and notebook `!` lines: how `torchrun` gets started.

scan() reads a script the way bash does, as far as these rules need: quotes, comments,
line continuations and heredocs (skipped), then splits it into simple commands.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from .core import Hit, rule

HEREDOC = re.compile(r"<<(-?)[ \t]*(['\"]?)([A-Za-z_]\w*)\2")
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")", ";;", "|&"}
PIPES = {"|", "|&"}
# Redirection operators as shlex splits them (`2>&1` is "2", ">&", "1"): they and their target are
# not arguments, and the command goes on after them (`torchrun ... > log 2>&1 &` runs in the background).
REDIRECTION = re.compile(r"^&?[<>]+[&|]?$")
FD_REDIRECTION = re.compile(r"(^|[\s;&|(])\d+(?=[<>])")
ARRAY_OPEN = re.compile(r"\s*(?:(?:local|declare|typeset)\s+(?:-a\s+)?)?\w+=\(")
WRAPPERS = {"exec", "nohup", "time", "env", "srun", "command", "uv", "run", "sudo", "numactl", "taskset"}
NO_VALUE = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "-m", "--module"}
# A word that may start Python: its name, or a variable expansion (`"$PY"`, `${PYTHON}`, `$VENV/bin/python`);
# what follows (`-m torch.distributed.run`) tells whether it launches anything.
INTERPRETER = re.compile(r"python|\{sys\.executable\}|^\$\{?\w+\}?$")
TORCHRUN_OPTION = re.compile(r"^--(nproc[-_]per[-_]node|nnodes|node[-_]rank|master[-_](addr|port)|standalone"
                             r"|rdzv[-_](backend|endpoint|id|conf)|max[-_]restarts)(=|$)")


@dataclass
class Command:
    first: int               # line numbers, 1-based
    last: int
    tokens: list
    background: bool = False  # ended by `&`
    loop: int = 0             # how many for/while/until bodies hold it


@dataclass
class Script:
    lines: list
    breaks: list = field(default_factory=list)     # (line, col, "comment" | "space")
    commands: list = field(default_factory=list)
    bang: bool = False                             # one `!cmd` line of a notebook
    depth: int = 0                                 # loop bodies open while scanning


def scan(text: str, bang: bool = False) -> Script:
    script = Script(text.splitlines(), bang=bang)
    quote, heredocs, pieces, first = None, [], [], None
    array = None   # a bash array being read (`cmd=(` ... `)`): its words are one command, run later by "${cmd[@]}"
    for n, raw in enumerate(script.lines, 1):
        if heredocs and quote is None:
            tabs, delim = heredocs[0]
            if (raw.lstrip("\t") if tabs else raw) == delim:
                heredocs.pop(0)
            continue
        code, j, cont = [], 0, False
        while j < len(raw):
            c = raw[j]
            if quote:
                if c == "\\" and quote == '"' and j + 1 < len(raw):
                    code.append(raw[j:j + 2])
                    j += 2
                    continue
                quote = None if c == quote else quote
            elif c in "'\"":
                quote = c
            elif c == "\\":
                if j + 1 == len(raw):
                    cont = True
                    break
                after = re.fullmatch(r"[ \t]+(#.*)?", raw[j + 1:])
                if after:  # bash escapes the blank: the line no longer continues
                    script.breaks.append((n, j + 1, "comment" if after.group(1) else "space"))
                code.append(raw[j:j + 2])
                j += 2
                continue
            elif c == "#" and (j == 0 or raw[j - 1] in " \t;|&()"):
                break
            elif raw.startswith("<<", j) and not raw.startswith("<<<", j):
                m = HEREDOC.match(raw, j)
                if m:
                    heredocs.append((m.group(1) == "-", m.group(3)))
            code.append(c)
            j += 1
        first = n if first is None else first
        pieces.append("".join(code) + ("\n" if quote else ""))
        if not (cont or quote):
            logical, pieces = "".join(pieces).replace("\n", " "), []
            depth = logical.count("(") - logical.count(")")
            opened = ARRAY_OPEN.match(logical)
            if array is None and opened and depth > 0:
                array = [first, logical[opened.end():], depth]
            elif array is not None:
                array[2] += depth
                if array[2] > 0:
                    array[1] += " " + logical
                else:
                    _commands(script, array[1] + " " + logical[:logical.rfind(")")], array[0], n)
                    array = None
            else:
                _commands(script, logical, first, n)
            first = None
    return script


def _commands(script: Script, code: str, first: int, last: int) -> None:
    code = FD_REDIRECTION.sub(r"\1", code)   # `2>&1` -> `>&1`: the descriptor is no argument
    lexer = shlex.shlex(code, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, ""
    try:
        tokens = list(lexer)
    except ValueError:  # something shlex cannot read ($'...', unbalanced quotes): no opinion
        return
    current: list = []
    pipeline = len(script.commands)   # the first command of the pipeline being read
    target = False                    # the next token is a redirection's target
    for tok in tokens + [";"]:
        if tok in SEPARATORS:
            if current and current[0] in ("do", "done"):
                script.depth = script.depth + 1 if current[0] == "do" else max(script.depth - 1, 0)
                current = current[1:]
            if current:
                script.commands.append(Command(first, last, current, False, script.depth))
            if tok == "&":   # `a | b &`: the whole pipeline runs in the background
                for cmd in script.commands[pipeline:]:
                    cmd.background = True
            if tok not in PIPES:
                pipeline = len(script.commands)
            current, target = [], False
        elif REDIRECTION.match(tok):
            target = True
        elif target:
            target = False
        else:
            current.append(tok)


def launcher(cmd: Command) -> tuple[str, int] | None:
    """("torchrun" | "torch.distributed.run" | "torch.distributed.launch", index of its first
    argument) when the command starts torchrun, possibly after env settings or srun/exec."""
    toks = cmd.tokens
    for i, tok in enumerate(toks):
        if tok.rsplit("/", 1)[-1] == "torchrun":
            return "torchrun", i + 1
        if tok == "-m" and i + 1 < len(toks) and toks[i + 1] in ("torch.distributed.run", "torch.distributed.launch"):
            return toks[i + 1], i + 2
        if not (re.match(r"^\w+=", tok) or tok in WRAPPERS or tok.startswith("-") or INTERPRETER.search(tok)
                or i and toks[i - 1] in ("-X", "-W")):   # the value of an interpreter's -X/-W option
            return None
    return None


def _at(script: Script, cmd: Command, text: str) -> Hit:
    """A hit on the last line of the command holding text (options follow the script name)."""
    line = max((n for n in range(cmd.first, cmd.last + 1) if text in script.lines[n - 1]), default=cmd.first)
    return Hit(line, col=script.lines[line - 1].find(text) + 1 if text in script.lines[line - 1] else 1)


@rule("DDP101", "A comment after a line-continuing backslash: the backslash escapes the blank after it, "
      "so the command ends on this line and the next lines run as commands of their own.",
      fix="end the line with the backslash itself; put comments on lines of their own above the command",
      section="comments", kind="shell")
def comment_after_backslash(script: Script):
    for line, col, what in script.breaks:
        if what == "comment":
            yield Hit(line, col=col)
        else:
            yield Hit(line, "Blanks after a line-continuing backslash: it escapes the blank instead of the "
                            "newline, so the command ends on this line.", col=col)


@rule("DDP102", "`!torchrun` in a notebook cell: a failed launch does not fail the cell, and the workers "
      "outlive an interrupted or restarted kernel.",
      fix="launch from Python: ddp_lab.engine.launch.torchrun(...) or subprocess.run([sys.executable, '-m', "
          "'torch.distributed.run', ...], check=True)",
      section="bang", kind="shell")
def bang_torchrun(script: Script):
    if script.bang:
        for cmd in script.commands:
            if launcher(cmd):
                yield _at(script, cmd, "torch" if "torch" in script.lines[cmd.first - 1] else "")


@rule("DDP103", "torch.distributed.launch is deprecated: it passes --local_rank to the script, and torchrun "
      "replaced it.",
      fix="use torchrun (or python -m torch.distributed.run) with the same options, and read "
          "os.environ['LOCAL_RANK'] in the script", kind="shell")
def deprecated_launch(script: Script):
    for cmd in script.commands:
        found = launcher(cmd)
        if found and found[0] == "torch.distributed.launch":
            yield _at(script, cmd, "torch.distributed.launch")


@rule("DDP104", "A torchrun option after the script name goes to the script, not to torchrun, which "
      "then runs with its default (one process).",
      fix="put every torchrun option (--nproc_per_node, --nnodes, ...) before the script or -m module",
      kind="shell")
def option_after_script(script: Script):
    for cmd in script.commands:
        found = launcher(cmd)
        if not found:
            continue
        args, i = cmd.tokens[found[1]:], 0
        while i < len(args) and args[i].startswith("-"):
            i += 1 if "=" in args[i] or args[i] in NO_VALUE else 2
        for arg in args[i + 1:]:
            if TORCHRUN_OPTION.match(arg):
                hit = _at(script, cmd, arg.split("=")[0])
                hit.message = (f"{arg.split('=')[0]} comes after the script {args[i]}: it goes to the script, "
                               "and torchrun runs with its default.")
                yield hit
                break


def option(cmd: Command, start: int, *names: str) -> str | None:
    """The value of a launcher option (`--name=v` or `--name v`, `_` or `-` spelling) before the script."""
    toks, wanted = cmd.tokens, {n.replace("_", "-") for n in names}
    i = start
    while i < len(toks) and toks[i].startswith("-"):
        name, eq, value = toks[i].partition("=")
        if name.replace("_", "-") in wanted:
            return value if eq else (toks[i + 1] if i + 1 < len(toks) else None)
        i += 1 if eq or toks[i] in NO_VALUE else 2
    return None


def _port(cmd: Command, start: int, script: Script | None = None) -> str | None:
    """A port written as digits: --master_port=29500, MASTER_PORT=29500 torchrun ..., or the port of
    --rdzv_endpoint=host:29400; or a variable the script sets to digits before the command
    (PORT=29500, PORT="${PORT:-29500}"): a port computed from anything else is not fixed."""
    port = option(cmd, start, "--master_port")
    if port is None:
        port = next((t.split("=", 1)[1] for t in cmd.tokens[:start] if t.startswith("MASTER_PORT=")), None)
    if port is None:
        endpoint = option(cmd, start, "--rdzv_endpoint") or ""
        port = endpoint.rsplit(":", 1)[1] if ":" in endpoint else None
    name = re.fullmatch(r"\$\{?(\w+)\}?", port or "")
    if name and script is not None:   # set once, before the launch (one set again in a loop is not fixed)
        sets = [c for c in script.commands if c.tokens[0].startswith(name.group(1) + "=")]
        value = sets[0].tokens[0].split("=", 1)[1] if len(sets) == 1 and sets[0].first < cmd.first else ""
        default = re.fullmatch(r"\$\{%s:?-(\d+)\}" % name.group(1), value)
        port = default.group(1) if default else value
    return port if port and port.isdigit() else None


def sbatch(script: Script, *names: str) -> str | None:
    """The value of an `#SBATCH` option (the last one given), `--name=v`, `--name v`, `-N v` or `-Nv`."""
    value = None
    for line in script.lines:
        if line.startswith("#SBATCH"):
            words = line[len("#SBATCH"):].split("#", 1)[0].split()
            for i, word in enumerate(words):
                name, eq, v = word.partition("=")
                if name in names:
                    value = v if eq else (words[i + 1] if i + 1 < len(words) else None)
                elif not word.startswith("--") and word[:2] in names and len(word) > 2:   # `-c8`
                    value = word[2:]
    return value


@rule("DDP105", "A fixed --master_port for launches that run at the same time on one machine (a loop or "
      "several commands sent to the background, a job array): the second one fails with EADDRINUSE "
      "(address already in use), or, with the c10d rendezvous, joins the first one's store and fails when "
      "that one ends.",
      fix="give each launch its own port (--master_port=$((29500 + i)); in a job array "
          "$((29500 + SLURM_ARRAY_TASK_ID))), or use --standalone (single node), which picks a free one",
      section="launch", kind="shell")
def fixed_port_twice(script: Script):
    array = sbatch(script, "--array", "-a") is not None
    seen: list = []
    for cmd in script.commands:
        if cmd.tokens[0] == "wait":
            seen = []   # the launches sent to the background before have ended
        found = launcher(cmd)
        port = _port(cmd, found[1], script) if found else None
        if port is None:
            continue
        node = option(cmd, found[1], "--node_rank")
        again = [c for c, p, n in seen if p == port and c.background and not (n and node and n != node)]
        if (cmd.loop and cmd.background) or again or array:
            written = any(port in script.lines[n - 1] for n in range(cmd.first, cmd.last + 1))
            hit = _at(script, cmd, port if written else
                      "--rdzv_endpoint" if option(cmd, found[1], "--rdzv_endpoint") else "--master_port")
            why = "inside a loop, sent to the background" if cmd.loop and cmd.background else \
                f"also used by the launch on line {again[0].first}, still running" if again else \
                "in a job array, whose tasks can share a machine"
            if option(cmd, found[1], "--rdzv_endpoint") and option(cmd, found[1], "--rdzv_backend") == "c10d":
                # measured on a real SLURM (notebook 10): no failure at the start, a shared store instead
                hit.message = (f"Port {port} is fixed {why}: the second torchrun on the same machine finds it "
                               "taken (EADDRINUSE), joins the first one's rendezvous store instead, and fails "
                               "(RendezvousConnectionError) if that one ends first.")
            else:
                hit.message = (f"Port {port} is fixed {why}: the second launch on the same machine fails with "
                               "EADDRINUSE (address already in use).")
            yield hit
        seen.append((cmd, port, node))


def _gpus_per_node(script: Script) -> int | None:
    """GPUs each node of this sbatch job gets, from --gpus-per-node, --gres=gpu:N, --gpus-per-task
    (times --ntasks-per-node) or --gpus over --nodes; None when the file does not say."""
    def count(text):
        last_part = (text or "").rsplit(":", 1)[-1]
        return int(last_part) if last_part.isdigit() else None
    per_node = sbatch(script, "--gpus-per-node")
    gres = next((g for g in (sbatch(script, "--gres") or "").split(",") if g.startswith("gpu")), None)
    if per_node or gres:
        return count(per_node or (gres if ":" in gres else "gpu:1"))
    tasks = sbatch(script, "--ntasks-per-node")
    per_task = count(sbatch(script, "--gpus-per-task"))
    if per_task and tasks is None and sbatch(script, "--ntasks", "-n") is None:
        return per_task                   # one task per node
    if per_task and count(tasks):
        return per_task * count(tasks)
    total, nodes = count(sbatch(script, "--gpus", "-G")), count(sbatch(script, "--nodes", "-N"))
    return total // nodes if total and nodes and total % nodes == 0 else None


@rule("DDP106", "--nproc_per_node starts more processes on a node than the GPUs this job asks for: "
      "processes share a GPU (NCCL refuses: 'Duplicate GPU detected') or pick a device that does not exist.",
      fix="make --nproc_per_node equal the GPUs per node the job requests (--gpus-per-node, --gres=gpu:N), "
          "or request as many GPUs as processes",
      kind="shell")
def nproc_over_gpus(script: Script):
    gpus = _gpus_per_node(script)
    if gpus is None:
        return
    for cmd in script.commands:
        found = launcher(cmd)
        nproc = option(cmd, found[1], "--nproc_per_node") if found else None
        if nproc and nproc.isdigit() and int(nproc) > gpus:
            hit = _at(script, cmd, "--nproc")
            hit.message = (f"--nproc_per_node={nproc} starts {nproc} processes per node, but the job asks for "
                           f"{gpus} GPU{'s' * (gpus != 1)} per node: processes share a GPU or pick one that "
                           "does not exist.")
            yield hit


@rule("DDP107", "srun starts --ntasks-per-node copies of torchrun on every node, and each starts "
      "--nproc_per_node workers: the torchruns of one node find their rendezvous port taken and join one "
      "rendezvous, where only one per node fits; the others wait, then fail when it ends.",
      fix="--ntasks-per-node=1 when srun starts torchrun (torchrun starts the node's workers); or drop "
          "torchrun and let srun start one task per GPU (--ntasks-per-node=GPUs, RANK from SLURM_PROCID)",
      section="slurm", kind="shell")
def tasks_times_nproc(script: Script):
    tasks = sbatch(script, "--ntasks-per-node")
    for cmd in script.commands:
        found = launcher(cmd)
        if not found or "srun" not in cmd.tokens[:found[1]]:
            continue
        per_node = option(cmd, cmd.tokens.index("srun") + 1, "--ntasks-per-node") or tasks
        if per_node and per_node.isdigit() and int(per_node) > 1:
            nproc = option(cmd, found[1], "--nproc_per_node")
            line = next((n for n, text in enumerate(script.lines, 1)
                         if "--ntasks-per-node" in text and per_node in text), cmd.first)
            hit = Hit(line, col=script.lines[line - 1].find("--ntasks-per-node") + 1)
            workers = f"{per_node} x {nproc} = {int(per_node) * int(nproc)}" if nproc and nproc.isdigit() else \
                f"{per_node} x --nproc_per_node"
            hit.message = (f"--ntasks-per-node={per_node}: srun starts {per_node} torchruns on every node, "
                           f"{workers} processes a node, not one world: the torchruns of a node share the "
                           "rendezvous port, only one per node joins, and the others fail when it ends.")
            yield hit


@rule("DDP108", "The rendezvous endpoint (or MASTER_ADDR) is the host the job was submitted from "
      "($SLURM_SUBMIT_HOST, the login node), not a node of the allocation: nothing listens there, and every "
      "torchrun waits for it until its rendezvous timeout.",
      fix="take the allocation's first node where the job runs: "
          "HEAD_NODE=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | sed -n 1p)",
      section="slurm", kind="shell")
def endpoint_from_login_node(script: Script):
    login = {"SLURM_SUBMIT_HOST"}
    for cmd in script.commands:   # names set from the submit host, also through other names
        for tok in cmd.tokens:
            name, eq, value = tok.partition("=")
            if eq and re.fullmatch(r"\w+", name) and any(re.search(r"\$\{?%s\b" % n, value) for n in login):
                login.add(name)
    for cmd in script.commands:
        found = launcher(cmd)
        values = [option(cmd, found[1], "--rdzv_endpoint"), option(cmd, found[1], "--master_addr")] if found else []
        values += [t.split("=", 1)[1] for t in cmd.tokens if t.startswith("MASTER_ADDR=")]
        for value in filter(None, values):
            used = next((n for n in login if re.search(r"\$\{?%s\b" % n, value)), None)
            if used:
                text = next((t for t in ("--rdzv_endpoint", "--master_addr", "MASTER_ADDR=")
                             if any(t in script.lines[k - 1] for k in range(cmd.first, cmd.last + 1))), "")
                hit = _at(script, cmd, text) if text else Hit(cmd.first)
                where = "" if used == "SLURM_SUBMIT_HOST" else " (set from $SLURM_SUBMIT_HOST)"
                hit.message = (f"The rendezvous endpoint comes from ${used}{where}, the host the job was submitted "
                               "from (the login node), not a node of the allocation: every torchrun waits "
                               "there until its rendezvous timeout (measured: 'timed out ... while trying to "
                               "connect to (ctl, 29500)').")
                yield hit
                break


# srun's options that take a value as the next word (`-c 8`, `--ntasks 4`); other short options are flags,
# and long ones without `=` take a value unless they are flags (SRUN_FLAGS).
SRUN_VALUED = set("AbBcCdDeGiJLmnNopqrStTwWx")
SRUN_FLAGS = {"--label", "--unbuffered", "--overlap", "--pty", "--verbose", "--quiet", "--overcommit", "--exact",
              "--whole", "--exclusive", "--kill-on-bad-exit", "--no-kill", "--oversubscribe", "--disable-status",
              "--multi-prog", "--test-only", "--nohup", "--spread-job", "--use-min-nodes", "--contiguous"}


def _srun(cmd: Command) -> tuple[list, int] | None:
    """(srun's option words, index of the program it starts) when the command runs srun."""
    toks = cmd.tokens
    at = toks.index("srun") if "srun" in toks else -1
    if at < 0 or not all(re.match(r"^\w+=", t) or t in WRAPPERS for t in toks[:at]):
        return None
    i = at + 1
    start = i
    while i < len(toks) and toks[i].startswith("-"):
        word = toks[i]
        if word.startswith("--"):
            i += 1 if "=" in word or word in SRUN_FLAGS else 2
        else:
            i += 2 if len(word) == 2 and word[1] in SRUN_VALUED else 1
    return toks[start:i], i


def _exported(script: Script, name: str, before: Command) -> bool:
    """name is in the environment of the command: set on it, or exported by an earlier line."""
    if any(t.startswith(name + "=") for t in before.tokens[:before.tokens.index("srun")]):
        return True
    for cmd in script.commands:
        if cmd.first >= before.first:
            break
        if cmd.tokens[0] in ("export", "declare", "typeset") and any(
                t == name or t.startswith(name + "=") for t in cmd.tokens[1:]):
            if cmd.tokens[0] == "export" or "-x" in cmd.tokens:
                return True
    return False


def _starts_training(cmd: Command, program: int) -> str | None:
    """What srun starts, when it is torchrun or Python: "torchrun" or the interpreter word."""
    words = [t for t in cmd.tokens[program:] if not re.match(r"^\w+=", t) and t not in WRAPPERS]
    first = words[0] if words else ""
    if launcher(cmd) or first.rsplit("/", 1)[-1] == "torchrun":
        return "torchrun"
    if "python" in first.lower() or re.fullmatch(r"\$\{?\w*PY\w*\}?", first, re.I):
        return first
    return None


@rule("DDP109", "srun starts the training without --cpus-per-task while the job asks for several CPUs a task: "
      "SLURM 22.05 to 23.02 do not pass the batch's --cpus-per-task on to srun, so where a site binds tasks to "
      "CPUs each task runs on 1 CPU and training slows many-fold.",
      fix="srun --cpus-per-task=$SLURM_CPUS_PER_TASK ... (or export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK "
          "before srun)",
      section="slurm", kind="shell")
def srun_without_cpus(script: Script):
    cpus = sbatch(script, "--cpus-per-task", "-c")
    if not (cpus and cpus.isdigit() and int(cpus) > 1):
        return
    for cmd in script.commands:
        found = _srun(cmd)
        what = _starts_training(cmd, found[1]) if found else None
        if not what or _exported(script, "SRUN_CPUS_PER_TASK", cmd):
            continue
        given = [w for w in found[0] if w.split("=")[0] in ("--cpus-per-task", "-c") or re.fullmatch(r"-c\d+", w)]
        if not given:
            hit = _at(script, cmd, "srun")
            hit.message = (f"srun starts {what} without --cpus-per-task while the job asks for --cpus-per-task="
                           f"{cpus}: SLURM 22.05-23.02 do not pass it on, and where tasks are bound to CPUs each "
                           "gets 1; give srun --cpus-per-task=$SLURM_CPUS_PER_TASK.")
            yield hit
