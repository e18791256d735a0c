"""11.1: a right bf16_in_hardware and the wrong ones, each with the hint it must get."""
import torch


def good(capability):
    return tuple(capability) >= (8, 0)


def counts_emulation(capability):
    return tuple(capability) >= (5, 3)   # what is_bf16_supported() says where a bf16 tensor can be made


def minor_only(capability):
    return capability[0] == 8 and capability[1] == 0 or capability[0] == 9


def major_eight_or_nine(capability):
    return capability[0] in (8, 9)


MISTAKES = {
    "emulation counted": (counts_emulation, "only emulate bf16"),
    "only A100 and H100": (minor_only, "not the minor number alone"),
    "majors 8 and 9 only": (major_eight_or_nine, "a major version above 9 counts too"),
}
