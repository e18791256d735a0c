"""`make gpu-check`: every GPU path of the workbook, run once on a CUDA machine, in one command.

    make gpu-check                                        # the venv's Python; results in docs/gpu_results.md
    python3 benchmarks/gpu_check.py --out DIR --budget 480   # any Python with torch (a cluster's module)

Without CUDA it prints one line and exits 0. With CUDA it runs, in this order, each check within
what is left of --budget seconds (the rest are reported "not run"):
  1. scripts/train_ddp.py on NCCL (2 ranks where there are 2 GPUs or more, else 1), ResNet-18 on
     synthetic images: fp32 with TF32 off, fp32 with TF32 on, bf16, fp16 with the GradScaler,
     bf16 with --sync-bn, bf16 with --compile; samples/s and the last loss of each;
     with 2 GPUs or more also bf16 with --sync-bn and a bf16 compression hook on 2 NCCL ranks
     (one GPU: reported "not run", as one GPU proves nothing between ranks);
  2. scripts/allreduce_bench.py on NCCL up to 256 MB: the best bus bandwidth;
  3. real nn.DataParallel over every GPU: one step's gradients against one module's;
  4. a CUDA memory snapshot of training steps (torch.cuda.memory._record_memory_history and
     _dump_snapshot, the file https://pytorch.org/memory_viz reads) and the peak memory;
  5. notebook 11's GPU statements: TF32's real matmul error against the lesson's emulation, fp32,
     TF32 and bf16 matmul speed, pinned against pageable host-to-GPU copies, and the graphs
     DDPOptimizer hands torch.compile on CUDA against the bucket count;
  6. notebook 08's probe on CUDA ranks: a real kineto trace read by the step budget (E5: until
     now tested only on a synthetic trace); with 2 GPUs or more, benchmarks/gpu_hang.py: an NCCL
     hang dumped by the Flight Recorder on timeout and read back by `ddp-lab autopsy` and torchfrtrace;
  7. nbval over every notebook (those that speak most of GPUs first), so their GPU cells run;
     --jobs N runs N notebooks at once where pytest-xdist is installed.
After each check the results so far are written into --doc as a section naming the date and the
machine (newest run first, earlier runs kept), so a run cut short still leaves its figures.
Logs and the snapshot go to --out. Exits 1 if a check that ran failed.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_RUN = re.compile(r"<!-- no-run -->.*?<!-- /no-run -->\n?", re.S)
RUNS = "<!-- runs -->"
TRAIN = ["--dataset", "synthetic", "--model", "resnet18", "--batch-size", "128", "--epochs", "1",
         "--max-steps", "60", "--log-every", "10", "--progress", "off", "--lr", "0.02"]
# name, train_ddp.py flags, environment. TF32 by the script's own flag, as users set it (--tf32 auto: on
# from compute capability 8.0, so "on" is off on older GPUs; off: exact fp32 matmuls and convolutions)
TRAIN_RUNS = [("fp32, TF32 off", ["--precision", "fp32", "--tf32", "off"], {}),
              ("fp32, TF32 on", ["--precision", "fp32", "--tf32", "auto"], {}),
              ("bf16 autocast", ["--precision", "bf16"], {}),
              ("fp16 + GradScaler", ["--precision", "fp16"], {}),
              ("bf16 + SyncBatchNorm", ["--precision", "bf16", "--sync-bn"], {}),
              ("bf16 + torch.compile", ["--precision", "bf16", "--compile"], {})]
# Between GPUs: what one GPU cannot show (with one rank NCCL moves nothing and SyncBatchNorm is plain
# BatchNorm). On a machine with one GPU these rows say "not run".
MULTI_GPU_RUNS = [("2 GPUs: train_ddp.py bf16 + SyncBatchNorm + bf16 compression hook",
                   ["--precision", "bf16", "--sync-bn", "--grad-compression", "bf16"], {})]
MIN_LEFT = 15  # seconds: a check is not started with less of the budget left
BENCH = ["--min-bytes", "1M", "--max-bytes", "256M", "--iters", "20", "--warmup", "5"]


@dataclass
class Result:
    name: str
    status: str          # pass, fail, not run
    figure: str = ""
    seconds: float = 0.0


def torchrun(nproc: int, script: str, args: list) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(ROOT / "scripts" / script), *args]


def run(cmd: list, log: Path, timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Runs a command in its own process group (torchrun's ranks included), output to `log`;
    on timeout the whole group is killed. Returns (exit status, last lines); 124 on timeout."""
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=f,
                             stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = p.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            code = 124
    return code, "\n".join(log.read_text(errors="replace").splitlines()[-3:])


def train_figure(metrics: Path) -> str:
    """Median samples/s of the train records after the first (warm-up) window, and the last loss."""
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in recs if r.get("kind") == "train"][1:]
    if not train:
        return "no train record"
    sps = statistics.median(r["samples_per_s"] for r in train)
    return f"{sps:,.0f} samples/s, last loss {train[-1]['loss']:.4f}"


def bench_figure(doc: Path) -> str:
    bench = json.loads(doc.read_text())
    if bench["world_size"] == 1:  # nothing crosses a link: bus bandwidth is 0 by its definition
        return "1 rank: NCCL ran; nothing to cross a link (busbw is 0 by definition), 2+ GPUs measure it"
    best = max(bench["results"], key=lambda r: r["busbw"])
    return f"busbw {best['busbw'] / 1e9:.1f} GB/s at {best['bytes'] / 2**20:.0f} MiB (world {bench['world_size']})"


def trace_figure(folder: Path) -> str:
    """A real kineto trace (notebook 08's probe on CUDA ranks) through notebook 08's step budget: the
    steps must be read as GPU steps, and their parts must add up to the device's step window."""
    sys.path.insert(0, str(ROOT))
    from ddp_lab.lessons import profiling
    run = profiling.load_run(folder)
    if not run or not any(run.values()):
        raise ValueError(f"no annotated step in {folder}/rank*.json")
    steps = [s for ranks in run.values() for s in ranks]
    if not all(s.on_gpu for s in steps):
        raise ValueError("the trace holds no CUDA kernel: it is a CPU trace, not a GPU one")
    b = profiling.mean_budget(steps)
    parts = sum(b[k] for k in profiling.PARTS)
    if abs(parts - b["step"]) > 1e-6 + 1e-3 * b["step"]:
        raise ValueError(f"the parts add up to {parts * 1e3:.3f} ms, the step window is {b['step'] * 1e3:.3f} ms")
    return (f"{len(run)} rank(s), {len(steps)} GPU step(s): window {b['step'] * 1e3:.2f} ms = forward "
            f"{b['forward'] * 1e3:.2f} + backward {b['backward'] * 1e3:.2f} + optimizer {b['optimizer'] * 1e3:.2f} + "
            f"exposed comm {b['exposed comm'] * 1e3:.2f} + other {b['other'] * 1e3:.2f} ms; "
            f"NCCL kernels {b['comm'] * 1e3:.2f} ms, {b['hidden comm'] * 1e3:.2f} hidden")


def hang_check(out: Path, nproc: int, timeout_s: float = 20) -> str:
    """benchmarks/gpu_hang.py on `nproc` NCCL ranks with the Flight Recorder on: the job must fail at
    its timeout, every rank must leave a dump, and the autopsy must name the all_reduce and the rank
    that never joined it. torchfrtrace's own reading is kept beside the logs."""
    folder = out / "nccl_hang"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
           "TORCH_FR_DUMP_TEMP_FILE": str(folder / "nccl_trace_rank_")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "benchmarks" / "gpu_hang.py"), "--timeout", str(timeout_s)]
    job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s * 4 + 60)
    (out / "nccl_hang.log").write_text(job.stdout + job.stderr)
    dumps = sorted(p.name for p in folder.glob("nccl_trace_rank_*"))
    print(f"job exit {job.returncode}; dumps: {dumps}")
    assert job.returncode != 0, "the hang did not fail: rank 0's extra all_reduce completed"
    assert len(dumps) == nproc, f"{len(dumps)} Flight Recorder dump(s) for {nproc} ranks"
    fr = subprocess.run([shutil.which("torchfrtrace") or "torchfrtrace", str(folder), "-p", "nccl_trace_rank_"],
                        capture_output=True, text=True, timeout=120) if shutil.which("torchfrtrace") else None
    if fr is not None:
        (out / "torchfrtrace.txt").write_text(fr.stdout + fr.stderr)
    sys.path.insert(0, str(ROOT))
    from ddp_lab.autopsy.diagnose import diagnose_folder
    d = diagnose_folder(str(folder), nproc)
    assert d is not None, "the autopsy found nothing in the dumps"
    text = d.headline
    print(text)
    assert "all_reduce" in text, text
    return f"{nproc} NCCL ranks, dumps {len(dumps)}/{nproc}; autopsy: {text[:200]}"


def dataparallel_check(device_ids: list) -> str:
    """One step of nn.DataParallel over `device_ids` against the same module on one device:
    the gradients must agree (DataParallel scatters the batch and sums the replicas' gradients)."""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    x, y = torch.randn(512, 64), torch.randint(0, 10, (512,))
    first = torch.device("cuda", device_ids[0]) if device_ids else torch.device("cpu")
    single = model.to(first)
    torch.nn.functional.cross_entropy(single(x.to(first)), y.to(first)).backward()
    expected = [p.grad.clone() for p in single.parameters()]
    single.zero_grad()
    dp = torch.nn.DataParallel(single, device_ids=device_ids or None)
    torch.nn.functional.cross_entropy(dp(x.to(first)), y.to(first)).backward()
    diff = max((p.grad - e).abs().max().item() for p, e in zip(single.parameters(), expected))
    assert diff < 1e-4, f"DataParallel's gradients differ from one module's by {diff:.2e}"
    return f"{len(device_ids)} GPU(s), gradients equal to one module's (max difference {diff:.1e})"


def memory_check(snapshot: Path) -> str:
    """A few training steps with the allocator's history recorded; the snapshot must hold them."""
    import pickle
    import torch
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    for _ in range(3):
        model(torch.randn(256, 2048, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.memory._dump_snapshot(str(snapshot))
    torch.cuda.memory._record_memory_history(enabled=None)
    snap = pickle.loads(snapshot.read_bytes())
    events = sum(len(t) for t in snap["device_traces"])
    assert snap["segments"] and events, "the snapshot holds no segment or no allocation event"
    peak = torch.cuda.max_memory_allocated() / 2**20
    print(torch.cuda.memory_summary(abbreviated=True))
    return f"{len(snap['segments'])} segments, {events} allocator events, peak {peak:,.0f} MiB; view {snapshot.name} at pytorch.org/memory_viz"


def precision_check() -> str:
    """Notebook 11's precision statements on the silicon: TF32's relative matmul error (real, against
    the lesson's emulation, gpus.matmul_errors), and fp32, TF32 and bf16 matmul TFLOP/s."""
    import torch
    sys.path.insert(0, str(ROOT))
    from ddp_lab.lessons import gpus
    emulated = gpus.matmul_errors(512)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(512, 512, generator=g, dtype=torch.float64)
    b = torch.randn(512, 512, generator=g, dtype=torch.float64)
    exact = a @ b
    real = {}
    for mode in ("ieee", "tf32"):   # the recipe's one API (notebook 11 section 5), getters keep working
        torch.set_float32_matmul_precision("high" if mode == "tf32" else "highest")
        c = a.float().cuda() @ b.float().cuda()
        real[mode] = float((c.double().cpu() - exact).norm() / exact.norm())
    real["bf16"] = float(((a.cuda().bfloat16() @ b.cuda().bfloat16()).double().cpu() - exact).norm() / exact.norm())
    speed = {}
    n = 8192
    for mode, dtype in (("fp32", torch.float32), ("tf32", torch.float32), ("bf16", torch.bfloat16)):
        torch.set_float32_matmul_precision("high" if mode == "tf32" else "highest")
        x, y = torch.randn(n, n, device="cuda", dtype=dtype), torch.randn(n, n, device="cuda", dtype=dtype)
        for _ in range(2):
            x @ y
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            x @ y
        stop.record()
        torch.cuda.synchronize()
        speed[mode] = 2 * n**3 * 5 / (start.elapsed_time(stop) / 1e3) / 1e12
    torch.set_float32_matmul_precision("highest")
    cap = torch.cuda.get_device_capability()
    print(f"capability {cap}, gpus.bf16_in_hardware: {gpus.bf16_in_hardware(cap)}, "
          f"torch.cuda.is_bf16_supported(): {torch.cuda.is_bf16_supported()}")
    print("relative error, real:", {k: f"{v:.2e}" for k, v in real.items()},
          "emulated:", {k: f"{v:.2e}" for k, v in emulated.items()})
    print("TFLOP/s:", {k: round(v, 1) for k, v in speed.items()})
    assert real["ieee"] < 1e-5 < real["tf32"], real   # TF32 on changes the result, off keeps fp32's
    assert 0.2 < real["tf32"] / emulated["tf32"] < 5, (real, emulated)
    # pinned against pageable host memory, 256 MiB to the GPU
    host = torch.ones(64 * 2**20)
    rates = {}
    for name, t in (("pageable", host), ("pinned", host.pin_memory())):
        t.cuda(non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            t.cuda(non_blocking=True)
        torch.cuda.synchronize()
        rates[name] = 5 * t.numel() * 4 / (time.perf_counter() - t0) / 1e9
    print("host to GPU GB/s:", {k: round(v, 1) for k, v in rates.items()})
    return (f"TF32 error {real['tf32']:.1e} (lesson's emulation {emulated['tf32']:.1e}), fp32 {real['ieee']:.1e}, "
            f"bf16 {real['bf16']:.1e}; TFLOP/s fp32 {speed['fp32']:.0f}, TF32 {speed['tf32']:.0f}, bf16 {speed['bf16']:.0f}; "
            f"copies pinned {rates['pinned']:.0f} GB/s, pageable {rates['pageable']:.0f} GB/s")


def compile_check(devices=("cuda", "cpu"), make=None) -> str:
    """The graphs torch.compile hands its backend for DDP(model.compile()) and torch.compile(DDP(model)),
    on one CUDA rank (NCCL) and on one CPU rank (gloo) with this torch, for a model class with its own
    forward (as users write them): notebook 11 (section 2) says both orders compile and DDPOptimizer
    splits them per bucket, the same on GPUs, as the split reads only the bucket cap. Every count must
    be above zero (0 = 0 would prove nothing). Gradients against eager DDP. `devices` and `make` (the
    model's constructor) let the tests run the CPU half, and see it fail on a bare nn.Sequential."""
    import socket
    import torch
    import torch._dynamo as dynamo
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    sys.path.insert(0, str(ROOT))
    from ddp_lab.lessons import buckets, models
    cap_mb, given, counts = 1.0, [], {}
    make = make or models.WideMLP

    def counting(gm, example_inputs):
        given.append(len(gm.graph.nodes))
        return gm.forward

    for dev in (torch.device(d, 0) if d == "cuda" else torch.device(d) for d in devices):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=0, world_size=1, **({"device_id": dev} if dev.type == "cuda" else {}))

        def fresh():
            torch.manual_seed(0)
            return make(width=512, depth=4).to(dev)
        x, y = torch.randn(32, 64, device=dev), torch.randint(0, 10, (32,), device=dev)
        eager = fresh()
        F.cross_entropy(DDP(eager, bucket_cap_mb=cap_mb)(x), y).backward()
        sizes = [p.numel() * p.element_size() for p in eager.parameters()]
        predicted = len(buckets.assign(sizes, int(cap_mb * buckets.MB), int(cap_mb * buckets.MB)))
        for order in ("torch.compile(DDP(model))", "DDP(model.compile())"):
            dynamo.reset()
            given.clear()
            model = fresh()
            if order.startswith("torch.compile"):
                step = torch.compile(DDP(model, bucket_cap_mb=cap_mb), backend=counting)
            else:
                model.compile(backend=counting)
                step = DDP(model, bucket_cap_mb=cap_mb)
            F.cross_entropy(step(x), y).backward()
            same = all(torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)
                       for p, q in zip(model.parameters(), eager.parameters()))
            counts[dev.type, order] = len(given)
            print(f"{dev.type}: {order}: {len(given)} graph(s) for {predicted} bucket(s), gradients equal to eager: {same}")
            assert same, (dev, order)
        dist.destroy_process_group()
    first = devices[0]
    for order in ("torch.compile(DDP(model))", "DDP(model.compile())"):
        assert all(counts[d, order] > 0 for d in devices), (order, counts)           # something was compiled
        assert len({counts[d, order] for d in devices}) == 1, counts   # the split does not depend on the device
    return (f"torch {torch.__version__}, a model class: DDP(model.compile()) {counts[first, 'DDP(model.compile())']} graph(s), "
            f"torch.compile(DDP(model)) {counts[first, 'torch.compile(DDP(model))']}, for {predicted} buckets, "
            f"the same on {' and '.join(d.upper() for d in devices)}; gradients equal to eager")


def notebooks_first_gpu() -> list:
    """Every lesson and solution: those whose code mentions CUDA first, the ones that speak most
    of GPUs (CUDA, GPU, NCCL in any cell) before the others."""
    books = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb")) + sorted((ROOT / "notebooks" / "solutions").glob("*.ipynb"))
    cells = {b: json.loads(b.read_text())["cells"] for b in books}
    code = {b: "".join("".join(c["source"]) for c in cells[b] if c["cell_type"] == "code") for b in books}
    talk = {b: len(re.findall(r"cuda|gpu|nccl", "".join("".join(c["source"]) for c in cells[b]), re.I)) for b in books}
    gpu = sorted((b for b in books if "cuda" in code[b]), key=lambda b: -talk[b])
    return gpu + [b for b in books if b not in gpu]


def nbval_figure(log_text: str) -> tuple[bool, str]:
    """Cells passed and failed, from pytest -v lines: "nb.ipynb::Cell 3 PASSED" one at a time,
    "[gw1] [ 96%] FAILED nb::ipynb::Cell 3" under pytest-xdist."""
    found = re.findall(r"(notebooks/\S+?)(?:\.|::)ipynb::Cell \d+ (PASSED|FAILED|ERROR)", log_text)
    found += [(b, k) for k, b in re.findall(r"\] (PASSED|FAILED|ERROR) (notebooks/\S+?)(?:\.|::)ipynb::Cell \d+", log_text)]
    counts = {k: sum(1 for _, s in found if s == k) for k in ("PASSED", "FAILED", "ERROR")}
    books = sorted({f"{b}.ipynb" for b, k in found if k != "PASSED"})
    ok = counts["FAILED"] == counts["ERROR"] == 0
    return ok, (f"{counts['PASSED']} cells passed, {counts['FAILED'] + counts['ERROR']} failed"
                + (f" ({', '.join(Path(b).name for b in books)})" if books else ""))


def machine() -> dict:
    import torch
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip().splitlines() if shutil.which("nvidia-smi") else []
    cap, nccl = torch.cuda.get_device_capability(0), torch.cuda.nccl.version()  # a tuple, an int in old torch
    return {"gpus": torch.cuda.device_count(), "name": torch.cuda.get_device_name(0),
            "smi": smi[0] if smi else "nvidia-smi: not found", "capability": f"{cap[0]}.{cap[1]}",
            "native_bf16": cap >= (8, 0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)}


def section(started: str, m: dict, results: list) -> str:
    lines = [f"## {started}: {m['gpus']} × {m['name']}",
             "",
             f"nvidia-smi: {m['smi']}; compute capability {m['capability']} "
             f"(bf16 {'in hardware' if m['native_bf16'] else 'emulated: no bf16 tensor cores before 8.0'}); "
             f"torch {m['torch']}, CUDA {m['cuda']}, NCCL {m['nccl']}. `make gpu-check`, {sum(r.seconds for r in results):.0f} s.",
             "",
             "| check | result | figure | seconds |", "|---|---|---|---|"]
    lines += [f"| {r.name} | {r.status} | {r.figure.replace('|', '/')} | {r.seconds:.0f} |" for r in results]
    return "\n".join(lines) + "\n"


def write_doc(doc: Path, started: str, m: dict, results: list) -> None:
    """Puts this run's section first under the runs marker, replacing its own earlier write."""
    text = doc.read_text() if doc.exists() else f"# GPU results\n\n{RUNS}\n"
    if RUNS not in text:
        text = text.rstrip("\n") + f"\n\n{RUNS}\n"
    head, runs = text.split(RUNS, 1)
    runs = re.sub(rf"\n## {re.escape(started)}:.*?(?=\n## |\Z)", "", "\n" + runs.lstrip("\n"), flags=re.S)
    text = NO_RUN.sub("", head) + RUNS + "\n\n" + section(started, m, results) + runs.rstrip("\n") + "\n"
    tmp = doc.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, doc)  # whole file or nothing


def plan(out: Path, nproc: int, notebooks_at_once: int = 1) -> list:
    """The checks in order: (name, command, environment, seconds at most, how to read its figure)."""
    jobs = []
    for name, flags, env in TRAIN_RUNS:
        metrics = out / f"train_{len(jobs)}.jsonl"
        jobs.append((f"train_ddp.py {name}", torchrun(nproc, "train_ddp.py", [*TRAIN, *flags, "--metrics-out", str(metrics)]),
                     env, 120, lambda metrics=metrics: train_figure(metrics)))
    profile = out / "profile"
    jobs.append((f"08: a real GPU trace through the step budget, {nproc} rank(s)",
                 [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                  "-m", "ddp_lab.experiments.nb08_profile", "--out", str(profile), "--models", "wide",
                  "--sizes", str(nproc), "--rounds", "1", "--steps", "2", "--profile", "3"],
                 {}, 120, lambda: trace_figure(profile / f"wide_n{nproc}")))
    for name, flags, env in MULTI_GPU_RUNS:
        if nproc < 2:
            jobs.append((name, None, env, 0, "needs 2 or more GPUs; this machine has 1"))
            continue
        metrics = out / f"train_{len(jobs)}.jsonl"
        jobs.append((name, torchrun(nproc, "train_ddp.py", [*TRAIN, *flags, "--metrics-out", str(metrics)]),
                     env, 120, lambda metrics=metrics: train_figure(metrics)))
    bench = out / "allreduce.json"
    jobs.append((f"allreduce_bench.py, NCCL, {nproc} rank(s)", torchrun(nproc, "allreduce_bench.py", [*BENCH, "--json-out", str(bench)]),
                 {}, 90, lambda: bench_figure(bench)))
    hang = "2 GPUs: an NCCL hang read back from the Flight Recorder (autopsy, torchfrtrace)"
    jobs.append((hang, [sys.executable, str(Path(__file__).resolve()), "--inner", "hang", "--out", str(out)], {}, 180, None)
                if nproc >= 2 else (hang, None, {}, 0, "needs 2 or more GPUs; this machine has 1"))
    for inner, name in (("dataparallel", "nn.DataParallel"), ("memory", "memory snapshot"),
                        ("precision", "11: TF32, bf16, pinned copies"), ("compile", "11: DDP + torch.compile on CUDA")):
        jobs.append((name, [sys.executable, str(Path(__file__).resolve()), "--inner", inner, "--out", str(out)], {}, 90, None))
    books = [str(b.relative_to(ROOT)) for b in notebooks_first_gpu()]
    parallel = ["-n", str(notebooks_at_once), "--dist", "loadfile"] if notebooks_at_once > 1 else []
    jobs.append(("nbval, every notebook", [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *parallel, *books],
                 {}, 10**6, "nbval"))
    return jobs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "build" / "gpu_check"), help="logs, metrics, the snapshot")
    ap.add_argument("--doc", default=str(ROOT / "docs" / "gpu_results.md"), help="where the figures are written")
    ap.add_argument("--budget", type=float, default=480, help="seconds for all checks together (default 480)")
    ap.add_argument("--only", help="run only the checks whose names contain one of these comma-separated words "
                    "(e.g. nbval,11:), e.g. to rerun what failed")
    ap.add_argument("--jobs", type=int, default=1, help="notebooks run at once (needs pytest-xdist; default 1)")
    ap.add_argument("--inner", choices=["dataparallel", "memory", "precision", "compile", "hang"], help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    import torch
    if a.inner:  # one check in its own process: a CUDA error there cannot take the others down
        ids = list(range(torch.cuda.device_count()))
        checks = {"dataparallel": lambda: dataparallel_check(ids), "precision": precision_check, "compile": compile_check,
                  "hang": lambda: hang_check(Path(a.out), min(len(ids), 2)),
                  "memory": lambda: memory_check(Path(a.out) / "memory_snapshot.pickle")}
        print(checks[a.inner]())
        return 0
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}), nothing to check; "
              "run `make gpu-check` on a machine with an NVIDIA GPU")
        return 0
    out, doc, end = Path(a.out), Path(a.doc), time.time() + a.budget
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PET_LOG_DIR", str(out / "torchelastic"))  # torchrun's logs with the others, not in /tmp
    m, started = machine(), datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    nproc = 2 if m["gpus"] >= 2 else 1
    print(f"gpu-check: {m['gpus']} × {m['name']}, torch {m['torch']}, {nproc} rank(s), budget {a.budget:.0f} s", flush=True)
    if a.jobs > 1 and importlib.util.find_spec("xdist") is None:
        print(f"gpu-check: --jobs {a.jobs} needs pytest-xdist (pip install pytest-xdist); the notebooks run one at a time")
        a.jobs = 1
    jobs = plan(out, nproc, a.jobs)
    results, failed = [], False
    for i, (name, cmd, env, limit, figure) in enumerate(jobs):
        left = end - time.time()
        if a.only and not any(w.strip().lower() in name.lower() for w in a.only.split(",")):
            continue  # left out by --only: no row
        if cmd is None:  # a check this machine cannot run: a row that says why
            results.append(Result(name, "not run", figure))
            continue
        if left < MIN_LEFT:
            results.append(Result(name, "not run", f"the {a.budget:.0f} s budget was spent"))
            continue
        t0, log = time.time(), out / f"{i:02d}.log"
        code, tail = run(cmd, log, min(limit, left), env)
        r = Result(name, "pass" if code == 0 else "fail", seconds=time.time() - t0)
        try:
            if figure == "nbval":
                ok, r.figure = nbval_figure(log.read_text(errors="replace"))
                r.status = "fail" if not ok or code not in (0, 124) else ("pass" if code == 0 else "cut at the budget")
                if code == 124:
                    r.figure += "; cut at the budget before the last notebooks"
            elif code == 0:
                r.figure = figure() if figure else (tail.splitlines() or [""])[-1]
            else:
                r.figure = ("timed out: " if code == 124 else f"exit {code}: ") + tail.replace("\n", " / ")[-300:]
        except (OSError, ValueError, KeyError) as e:
            r.status, r.figure = "fail", f"no figure: {e}"
        failed |= r.status == "fail"
        results.append(r)
        print(f"  {r.status:9s} {name}: {r.figure} ({r.seconds:.0f} s)", flush=True)
        write_doc(doc, started, m, results)
    write_doc(doc, started, m, results)
    print(f"gpu-check: written to {doc}; logs in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
