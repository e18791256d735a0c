"""04.5: a right precision plan and the wrong ones, each with the hint it must get."""
import torch


def good(device_type, has_bf16):
    return (torch.bfloat16, False) if has_bf16 else (torch.float16, True)


def fp16_no_scaler(device_type, has_bf16):
    return torch.float16, False


def bf16_everywhere(device_type, has_bf16):
    return torch.bfloat16, False


def bf16_with_scaler(device_type, has_bf16):
    return (torch.bfloat16, True) if has_bf16 else (torch.float16, True)


def fp32(device_type, has_bf16):
    return torch.float32, False


MISTAKES = {
    "fp16 without a scaler": (fp16_no_scaler, "fp16 needs a GradScaler"),
    "bf16 where there is none": (bf16_everywhere, "this device has no bf16"),
    "a scaler with bf16": (bf16_with_scaler, "drop the GradScaler"),
    "fp32": (fp32, "fp32 is not mixed precision"),
}
