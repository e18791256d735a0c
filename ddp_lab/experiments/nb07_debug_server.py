"""Notebook 07, deep dive: torch's debug server, live, on a job that hangs.

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb07_debug_server --port 8123 --release /tmp/go
    # while it hangs, open http://localhost:8123/stacks and /fr_trace_json; then `touch /tmp/go`

Every rank starts torch.distributed.debug's server after init: a worker server on each rank, and on
rank 0 the frontend at --port, which asks every rank's worker server and shows the answers on one
page (it needs aiohttp and tabulate). Then the hang: rank 0 all-reduces a metric and waits for
rank 1, which is elsewhere (waiting for the file --release, as a rank stuck in its own work
would be). Once the file exists, rank 1 joins the all_reduce and the job ends normally.

Below main(), the notebook's side: it reads the frontend's pages over HTTP with the standard
library, from outside the job, as a browser would.
"""
import argparse
import html
import os
import re
import time
import urllib.request

import torch
import torch.distributed as dist

from ddp_lab.engine import runtime


def elsewhere(release: str) -> None:
    while not os.path.exists(release):    # rank 1 is busy here: it has not reached the all_reduce
        time.sleep(0.1)


def step(rank: int, release: str) -> float:
    metric = torch.tensor([float(rank)])
    if rank != 0:
        elsewhere(release)
    dist.all_reduce(metric)               # rank 0 waits here until rank 1 comes
    return metric.item()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True, help="the frontend's HTTP port, on rank 0")
    parser.add_argument("--release", required=True, help="rank 1 waits until this file exists")
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")   # the Flight Recorder on, before init
    from torch.distributed import debug
    with runtime.distributed() as ctx:
        debug.start_debug_server(port=args.port)            # every rank; rank 0 also the frontend
        try:
            ctx.record(kind="step", total=step(ctx.rank, args.release))
        finally:
            if ctx.rank == 0:             # the frontend is a process of rank 0's: end it with the job
                debug.stop_debug_server()


# ---- the notebook's side: the frontend's pages, read over HTTP ------------------------------

_RANK = re.compile(r"<h2>Rank (\d+): [^<]*</h2>\s*(?:<p>([^<]*)</p>\s*)?<pre>(.*?)</pre>", re.S)


def ranks_of(page_html: str) -> dict:
    """{rank: text} from a frontend page with one <pre> per rank (/stacks, /fr_trace_json). A rank
    the frontend could not reach keeps the frontend's note ("Failed to fetch: ...") before its text."""
    return {int(rank): html.unescape(f"{note}\n{text}" if note else text)
            for rank, note, text in _RANK.findall(page_html)}


def page(port: int, path: str, timeout: float = 90) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
        return resp.read().decode()


def wait_for_hang(port: int, hung, running=lambda: True, world_size: int = 2, limit: float = 180) -> dict:
    """Read /stacks until hung({rank: stack text}) is true, and return those stacks. At most
    `limit` seconds: on a busy machine the ranks start slowly, and the frontend answers only once
    every rank has registered its worker server. running() false: the job ended first."""
    deadline, last = time.monotonic() + limit, "no answer"
    while time.monotonic() < deadline:
        if not running():
            raise RuntimeError(f"the job ended before the debug server on port {port} showed the hang; "
                               f"its last answer: {last[:1500]}")
        try:
            stacks = ranks_of(page(port, "/stacks"))
        except OSError as exc:            # not listening yet (urllib's errors are OSErrors)
            last = repr(exc)
        else:
            if len(stacks) == world_size and hung(stacks):
                return stacks
            last = repr(stacks)
        time.sleep(0.5)
    raise TimeoutError(f"the debug server on port {port} did not show the hang within {limit:g} s; "
                       f"its last answer: {last[:1500]}")


if __name__ == "__main__":
    main()
