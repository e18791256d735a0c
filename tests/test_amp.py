"""ddp_lab.lessons.amp: what autocast changes, number ranges, loss scaling, GradScaler, clipping, cost."""
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ddp_lab.lessons import amp, models


def test_census_casts_compute_not_parameters():
    x, y = torch.rand(4, 1, 8, 8), torch.zeros(4, dtype=torch.long)
    rows = {r["layer"]: r for r in amp.dtype_census(models.cnn(), x, torch.bfloat16, y=y)}
    convs_and_linears = [r for r in rows.values() if r["type"] in ("Conv2d", "Linear")]
    assert len(convs_and_linears) == 4
    assert all(r["output"] == "bf16" and r["params"] == "fp32" for r in convs_and_linears)
    assert rows["0"]["input"] == "fp32"            # the data arrives in fp32, the conv casts it
    assert rows["loss"]["output"] == "fp32"        # cross-entropy runs in fp32


def test_ranges_match_the_formats():
    r = amp.ranges()
    assert r["fp16"]["max"] == 65504.0
    assert r["fp16"]["min_subnormal"] == 2.0 ** -24
    assert r["bf16"]["min_normal"] == r["fp32"]["min_normal"]   # same 8 exponent bits
    assert r["bf16"]["eps"] == 2.0 ** -7 and r["fp16"]["eps"] == 2.0 ** -10


def test_fp16_underflow_is_rescued_by_loss_scaling_and_bf16_needs_none():
    d = amp.underflow_demo(grad_value=1e-8)
    assert d["fp32"].abs().min() > 0
    assert torch.count_nonzero(d["fp16"]) == 0
    torch.testing.assert_close(d["fp16 + scaling"], d["fp32"], rtol=2e-3, atol=0)
    torch.testing.assert_close(d["bf16"], d["fp32"], rtol=2e-2, atol=0)


def test_scaler_skips_poisoned_steps_halves_then_grows_back():
    trace = amp.scaler_trace(steps=25, inf_at=(5,), init_scale=1024.0, growth_interval=10)
    skipped = [r["step"] for r in trace if not r["stepped"]]
    assert skipped == [5]
    assert trace[5]["scale_after"] == 512.0
    assert trace[15]["scale_after"] == 1024.0      # 10 clean steps later: doubled
    assert all(r["scale_after"] == 512.0 for r in trace[5:15])


def test_clipping_scaled_gradients_shrinks_the_update_by_the_scale():
    d = amp.clip_demo(max_norm=0.1, init_scale=2.0 ** 16)
    ref, good, bad = d["reference"], d["unscale_first"], d["no_unscale"]
    assert good["norm_seen"] == pytest.approx(ref["norm_seen"], rel=1e-2)
    assert good["update_norm"] == pytest.approx(ref["update_norm"], rel=1e-2)
    assert bad["norm_seen"] / ref["norm_seen"] == pytest.approx(d["scale"], rel=1e-2)
    assert ref["update_norm"] / bad["update_norm"] == pytest.approx(d["scale"], rel=5e-2)


def test_bf16_halves_floating_point_activations():
    x, y = torch.rand(32, 1, 8, 8), torch.randint(0, 10, (32,))
    fp32 = amp.saved_activation_bytes(models.cnn(), x, y, "fp32")
    bf16 = amp.saved_activation_bytes(models.cnn(), x, y, "bf16")
    floats = lambda d: sum(v for k, v in d.items() if k in ("fp32", "bf16", "fp16"))
    assert abs(floats(bf16) / floats(fp32) - 0.5) < 0.02
    assert bf16.get("int64") == fp32.get("int64")  # max-pool indices do not shrink


def test_ranges_agree_with_real_conversions():
    r = amp.ranges()
    tiny = torch.tensor(0.0, dtype=torch.float16)
    assert torch.nextafter(tiny, torch.tensor(1.0, dtype=torch.float16)).item() == r["fp16"]["min_subnormal"]
    assert torch.tensor(r["fp16"]["max"] * 1.01).half().isinf()
    assert torch.tensor(r["bf16"]["min_normal"]).bfloat16().item() == r["bf16"]["min_normal"]


def test_matmul_time_is_the_fastest_product_after_a_warm_up(monkeypatch):
    # a fake clock: the warm-up product starts at 0 and is never timed; the 3 timed ones take 3, 2 and 4 ticks
    ticks = iter([0, 10, 13, 20, 22, 30, 34])
    monkeypatch.setattr(amp, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    assert amp.matmul_time(8, "bf16", steps=3) == 2
    assert next(ticks, None) is None  # one warm-up plus exactly `steps` timed products


def test_cpu_16bit_units_claim_only_what_the_cpu_has():
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to compare with")
    flags = set(cpuinfo.read_text().split())
    units = amp.cpu_16bit_units()
    assert set(units) == {"AVX512-BF16", "AMX (bf16)", "AMX-FP16"}
    for name, flag in (("AVX512-BF16", "avx512_bf16"), ("AMX (bf16)", "amx_tile"), ("AMX-FP16", "amx_fp16")):
        assert units[name] is not True or flag in flags, (name, flag)


def test_step_time_trains_in_every_precision():
    x, y = torch.rand(4, 1, 8, 8), torch.randint(0, 10, (4,))
    for precision in ("fp32", "bf16", "fp16"):
        torch.manual_seed(0)
        model = models.mlp()
        before = [p.detach().clone() for p in model.parameters()]
        seconds = amp.step_time(model, x, y, precision, steps=1)
        assert 0 < seconds < float("inf")
        assert all(torch.isfinite(p).all() for p in model.parameters()), precision
        assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters())), precision  # it stepped


def test_deprecated_cuda_amp_is_disabled_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("with a GPU torch.cuda.amp works (and warns that it is deprecated)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = torch.cuda.amp.GradScaler()
    assert not scaler.is_enabled()
    assert any("deprecated" in str(w.message) for w in caught)
    # not silent: it says that it disables itself
    assert any(issubclass(w.category, UserWarning) and "Disabling" in str(w.message) for w in caught)
