"""ddp_lab.lessons.gpus (notebook 11): TF32 rounding as a Tensor Core does it, bf16 in hardware, workers."""
import torch

from ddp_lab.lessons import gpus


def test_rounding_to_7_mantissa_bits_is_torchs_own_bf16_cast():
    x = torch.cat([torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 1e3,
                   torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 65504.0, 1e-30])])
    assert torch.equal(gpus.round_mantissa(x, 7), x.to(torch.bfloat16).float())


def test_tf32_keeps_10_mantissa_bits_and_rounds_ties_to_even():
    one = 1.0
    step = 2 ** -10                                     # TF32's spacing just above 1
    x = torch.tensor([one + step, one + step / 2, one + 3 * step / 2, one + step / 4 * 3])
    assert gpus.round_mantissa(x, gpus.TF32_MANTISSA_BITS).tolist() == [one + step, one, one + 2 * step, one + step]


def test_matmul_errors_follow_the_mantissa_bits():
    e = gpus.matmul_errors(128)
    assert e["fp32"] < e["tf32"] < e["bf16"]
    # three bits fewer: about 2**3 times the error
    assert 4 < e["bf16"] / e["tf32"] < 16


def test_bf16_in_hardware_from_ampere_on():
    assert [name for name, cap in gpus.GPUS.items() if not gpus.bf16_in_hardware(cap)] == ["V100", "T4"]
    assert gpus.bf16_in_hardware((8, 0)) and not gpus.bf16_in_hardware((7, 5))


def test_persistent_workers_keep_their_process():
    kept, fresh = gpus.worker_pids(True, epochs=2), gpus.worker_pids(False, epochs=2)
    assert kept[0] == kept[1] and fresh[0] != fresh[1]
