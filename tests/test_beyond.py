"""Notebooks 09 and 09b: the memory calculator and its per-tensor predictions (what the 2- and 4-rank
launch measures is asserted in notebook 09 itself, and 09b's launch in notebook 09b)."""
import math

import pytest
import torch

from ddp_lab.lessons import beyond, costmodel

GB = 1e9


def element_bytes(dtype) -> int:
    return torch.empty(1, dtype=dtype).element_size()


def adam_state_bytes_per_param(param) -> float:
    """Bytes of a real torch.optim.Adam's state per parameter element, after one step."""
    optimizer = torch.optim.Adam([param])
    param.grad = torch.ones_like(param)
    optimizer.step()
    state = optimizer.state[param]
    return sum(v.nbytes for k, v in state.items() if k != "step") / param.numel()


def torch_native_bytes() -> tuple:
    """(w, g, o) bytes per parameter that torch.autocast + Adam really leave behind."""
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.Adam(model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(8, 16)).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    n = sum(p.numel() for p in model.parameters())
    state = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    return (sum(p.nbytes for p in model.parameters()) / n, sum(p.grad.nbytes for p in model.parameters()) / n,
            sum(t.nbytes for t in state) / n)


def test_torch_native_recipe_is_what_autocast_and_adam_hold():
    r = beyond.RECIPES[beyond.DEFAULT]
    assert r.layout == beyond.TORCH
    assert (r.w, r.g, r.o) == torch_native_bytes()


def test_zero1_for_7b_on_8_devices_torch_native():
    w, g, o = torch_native_bytes()      # 4, 4, 8 read from real tensors
    P = 7e9
    expect = w * P + g * P + o * P / 8  # ZeRO-1: only the optimizer state is split
    got = beyond.per_device(P, 8, "zero1", beyond.RECIPES[beyond.DEFAULT])["total"]
    assert got == pytest.approx(expect) and round(got / GB) == 63


def test_deepspeed_recipe_is_bf16_weights_and_grads_plus_fp32_master_and_moments():
    master = torch.nn.Parameter(torch.zeros(32, 4))        # fp32 master copy, what Adam steps
    o = element_bytes(torch.float32) + adam_state_bytes_per_param(master)
    r = beyond.RECIPES["master+adam"]
    assert r.layout == beyond.DEEPSPEED
    assert (r.w, r.g, r.o) == (element_bytes(torch.bfloat16), element_bytes(torch.bfloat16), o)


def test_fp16_weights_of_7b():
    # The engineering article's "7B in FP16 is about 14 GB", from fp16's real element size
    r = beyond.RECIPES["fp16 weights only"]
    assert r.w == element_bytes(torch.float16) and r.g == r.o == 0
    assert round(beyond.per_device(7e9, 1, "ddp", r)["total"] / GB) == 14


def test_devices_needed_is_the_fewest_that_fit():
    r = beyond.RECIPES[beyond.DEFAULT]
    # torch-native, 7B, 24 GB: fp32 weights alone are 28 GB, so nothing short of sharding them fits
    assert beyond.devices_needed(7e9, "zero2", r, 24e9) is None
    n = beyond.devices_needed(7e9, "zero3", r, 24e9)
    assert n == math.ceil(7e9 * 16 / 24e9)


def test_zero_stages_match_the_zero_paper():
    # Rajbhandari et al. 2020, Fig. 1: 7.5B parameters, 64 GPUs, K = 12 -> 120, 31.4, 16.6, 1.9 GB
    r = beyond.RECIPES["master+adam"]
    got = [beyond.per_device(7.5e9, 64, s, r)["total"] / GB for s in beyond.STRATEGIES]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]


def test_per_device_parts_add_up_over_ranks():
    r = beyond.RECIPES["fp32+adam"]
    for s in beyond.STRATEGIES:
        d = beyond.per_device(1000, 4, s, r)
        assert d["total"] == pytest.approx(d["w"] + d["g"] + d["o"])
    assert beyond.per_device(1000, 4, "zero3", r)["total"] * 4 == beyond.per_device(1000, 4, "ddp", r)["total"]


def test_table_marks_what_fits():
    text = beyond.table([1e9, 70e9], world=8, device_gb=80)
    rows = text.splitlines()
    assert "before activations and runtime buffers" in rows[1]
    assert "16.0*" in rows[4] and "1,120.0 " in rows[5] and "140.0 " in rows[5]


@pytest.mark.parametrize("rows", [1, 3, 10, 16, 257])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_fsdp_rows_follow_torch_chunk(rows, world):
    chunks = torch.chunk(torch.empty(rows), world)
    expect = [len(chunks[r]) if r < len(chunks) else 0 for r in range(world)]
    assert [beyond.fsdp_rows(rows, world, r) for r in range(world)] == expect


def test_zero_partition_matches_zero_redundancy_optimizer():
    # ZeroRedundancyOptimizer's own partition, computed without a process group
    from torch.distributed.optim import ZeroRedundancyOptimizer
    params = [torch.nn.Parameter(torch.empty(n)) for n in (10, 300, 7, 300, 64, 1)]
    for world in (2, 3, 4):
        zero = object.__new__(ZeroRedundancyOptimizer)
        zero.world_size, zero._partition_parameters_cache = world, []
        zero.param_groups = [{"params": params}]
        theirs = [[id(p) for p in group[0]["params"]] for group in zero._partition_parameters()]
        ours = [[id(params[i]) for i in sorted(idx, key=lambda i: -params[i].numel())]
                for idx in beyond.zero_partition([p.numel() for p in params], world)]
        assert [sorted(t) for t in theirs] == [sorted(o) for o in ours]


def test_rank_bytes_totals():
    shapes = [(10, 4), (10,), (3, 10), (3,)]
    numel = 40 + 10 + 30 + 3
    ddp = beyond.rank_bytes(shapes, "ddp", 2, 0)
    assert ddp == {"params": 4 * numel, "grads": 4 * numel, "optim": 8 * numel + 4 * 4}
    for strategy in ("zero1", "fsdp"):
        per_rank = [beyond.rank_bytes(shapes, strategy, 3, r) for r in range(3)]
        assert sum(p["optim"] for p in per_rank) - 4 * 4 * (3 if strategy == "fsdp" else 1) == 8 * numel
    assert sum(beyond.rank_bytes(shapes, "fsdp", 3, r)["params"] for r in range(3)) == 4 * numel


def test_activation_formula_matches_what_autograd_saves():
    model = beyond.build_model()
    for batch in (1, 5, 32):
        x = torch.randn(batch, beyond.WIDTHS[0])
        assert beyond.saved_activation_floats(model, x) == beyond.mlp_activation_floats(beyond.WIDTHS, batch)


def test_comm_cost_agrees_with_notebook_03_ring():
    alpha, beta = 1e-4, 1e-9
    for n in (2, 4, 8):
        got = beyond.comm_cost([("all_reduce", 1e6)], n, alpha, beta)["seconds"]
        assert got == pytest.approx(float(costmodel.ring(1e6, n, alpha, beta)))
        half = beyond.comm_cost([("reduce_scatter", 1e6), ("all_gather", 1e6)], n, alpha, beta)["seconds"]
        assert half == pytest.approx(got)
    assert beyond.comm_cost([("all_reduce", 1e6)], 2)["seconds"] is None   # no alpha, beta: no time
