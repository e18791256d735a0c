"""The workbook on other machines than this one: older torch (pyproject: torch>=2.4) and GPUs.

What a GPU run of every notebook (an H200, torch 2.11, `make gpu-check`) found, checked here
without one:

On a GPU machine with torch 2.11 every launch of the workbook once failed with
"run.py: error: unrecognized arguments: --log-line-prefix-template": that flag is newer than
2.11. The launcher now gives torchrun the prefix through TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE,
read since torch 2.2. Here every flag the launchers pass is checked against the flags torch
2.11's torchrun printed in its usage message on that machine.

Simulated nodes on one machine with a GPU each took GPU 0 (NCCL: "invalid usage"), a kernel's
DataParallel demonstration put a CPU batch through a GPU replica, and FSDP2's collectives
in torch 2.11 are all_gather_into_tensor and reduce_scatter_tensor, which notebook 09's
byte counter did not wrap.
"""
import torch
import torch.distributed as dist

from ddp_lab.engine import elastic, launch
from ddp_lab.experiments import nb09_strategies
from ddp_lab.lessons import dataparallel, models

# torch 2.11.0's torchrun flags, from its usage message (underscore spellings are aliases)
TORCHRUN_2_11 = {
    "--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf",
    "--standalone", "--max-restarts", "--monitor-interval", "--start-method", "--event-log-handler",
    "--role", "--no-python", "--run-path", "--log-dir", "-r", "--redirects", "-t", "--tee",
    "--local-ranks-filter", "--node-rank", "--master-addr", "--master-port", "--local-addr",
}


def torchrun_flags(cmd):
    """The flags given to torch.distributed.run, up to the program it starts (a path or -m)."""
    flags = []
    for tok in cmd[cmd.index("torch.distributed.run") + 1:]:
        if tok == "-m" or tok.endswith(".py"):
            break
        if tok.startswith("-"):
            flags.append(tok.split("=")[0].replace("_", "-"))
    return flags


def test_single_and_multi_node_launch_lines_use_only_flags_torch_2_11_knows():
    for nnodes in (1, 2):
        flags = torchrun_flags(launch._node_cmd(["-m", "ddp_lab.experiments.nb00_hello"], 2, nnodes, 0, 29500, 0, []))
        assert "--nproc-per-node" in flags and "--tee" in flags, flags
        assert set(flags) <= TORCHRUN_2_11, set(flags) - TORCHRUN_2_11


def test_the_elastic_rehearsal_uses_only_flags_torch_2_11_knows():
    cluster = elastic.Cluster("-m ddp_lab.experiments.nb00_hello")  # builds its lines, starts nothing
    flags = torchrun_flags(cluster.command("a", host=True))
    assert "--rdzv-backend" in flags, flags
    assert set(flags) <= TORCHRUN_2_11, set(flags) - TORCHRUN_2_11


def test_a_launch_still_splits_its_output_by_rank():
    run = launch.torchrun("-m ddp_lab.experiments.nb00_hello", nproc=2, stream=False)
    assert sorted(run.rank_lines) == [0, 1]
    assert all(any("rank" in line for line in lines) for lines in run.rank_lines.values()), run.rank_lines
    assert not any("ddp-lab-" in line for line in run.log.splitlines()), "a prefix was left in the log"
    assert "--log-line-prefix-template" not in " ".join(run.cmd[0])


def test_simulated_nodes_get_gpus_of_their_own_or_none(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert launch.node_gpus(1, 2, {}) == [None]                   # one node: as it is
    assert launch.node_gpus(2, 2, {}) == ["0,1", "2,3"]           # like two machines of 2 GPUs
    assert launch.node_gpus(2, 4, {}) == ["", ""]                 # too few: the CPU, for every node
    assert launch.node_gpus(2, 1, {"CUDA_VISIBLE_DEVICES": "3,5"}) == ["3", "5"]  # the user's choice is the pool
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert launch.node_gpus(2, 1, {}) == ["", ""]                 # what the H200 machine needed


def test_dataparallel_demonstration_shows_the_cpu_case_on_a_gpu_machine(monkeypatch):
    import importlib
    data_parallel = importlib.import_module("torch.nn.parallel.data_parallel")  # the module, not the function
    monkeypatch.setattr(data_parallel, "_get_available_device_type", lambda: "cuda")
    monkeypatch.setattr(data_parallel, "_get_all_device_indices", lambda: [0])
    torch.manual_seed(0)
    report = dataparallel.dataparallel_on_cpu(models.mlp(), torch.randn(8, 64))
    assert report["device_ids"] == [] and report["outputs_equal"] and report["forward_calls"] == 2


def test_nb09_counts_fsdp2_collectives_by_their_older_names_too(monkeypatch):
    names = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
             "broadcast", "all_reduce")
    for name in names:
        monkeypatch.setattr(dist, name, getattr(dist, name))   # restored after the test
    monkeypatch.delattr(dist, "all_gather_single")             # torch 2.11 has neither
    monkeypatch.delattr(dist, "reduce_scatter_single")
    before = {n: getattr(dist, n) for n in names[2:]}
    nb09_strategies.install_counters()
    assert all(getattr(dist, n) is not before[n] for n in before), "a collective was left uncounted"
    assert not hasattr(dist, "all_gather_single")


def test_the_elastic_rehearsals_agents_see_no_gpu(monkeypatch):
    """Its agents share one machine, like simulated nodes: their ranks run on the CPU over gloo."""
    seen = []

    class Agent:
        def __init__(self, cmd, env, **kwargs):
            seen.append(env)

    monkeypatch.setattr(elastic.subprocess, "Popen", Agent)
    cluster = elastic.Cluster("-m ddp_lab.experiments.nb00_hello")
    cluster.start("a", host=True)
    assert seen and seen[0]["CUDA_VISIBLE_DEVICES"] == ""
