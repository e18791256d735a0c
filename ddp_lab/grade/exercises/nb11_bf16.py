"""11.1: bf16 in hardware, not emulated, from a GPU's compute capability; graded in the kernel.

The reference is a table of real GPUs and what their silicon does (bf16 Tensor Cores from Ampere,
compute capability 8.0, on), not the rule the lesson states: a V100 or T4 only emulates bf16,
although torch.cuda.is_bf16_supported() says True there by default.
"""
from ddp_lab.grade.core import Exercise, error_text, register

# (GPU, compute capability, bf16 Tensor Cores): NVIDIA's CUDA GPU list and architecture whitepapers
CASES = [("P100", (6, 0), False), ("V100", (7, 0), False), ("T4", (7, 5), False), ("A100", (8, 0), True),
         ("A10", (8, 6), True), ("L4", (8, 9), True), ("H100", (9, 0), True), ("B200", (10, 0), True),
         ("RTX 5090", (12, 0), True)]


def on_rank(answer, rank, world):
    out = {}
    for name, capability, _ in CASES:
        try:
            out[name] = bool(answer(capability))
        except Exception as exc:
            out[name] = error_text(exc)
    return out


def judge(per_rank):
    got = per_rank[0]
    errors = [f"{name}: {v}" for name, v in got.items() if isinstance(v, str)]
    if errors:
        return [f"your function raised for {errors[0]}: it gets a (major, minor) tuple such as (8, 6)"]
    wrong = [(name, cap, ok) for name, cap, ok in CASES if got[name] != ok]
    if not wrong:
        return []
    names = {name for name, _, _ in wrong}
    if names <= {"V100", "T4", "P100"}:
        why = ("those GPUs only emulate bf16 (torch.cuda.is_bf16_supported() counts emulation unless "
               "including_emulation=False): compare the capability with (8, 0)")
    elif names & {"A10", "L4"} and not names & {"A100", "H100"}:
        why = "any 8.x is Ampere or Ada: compare the tuple with (8, 0), not the minor number alone"
    elif names & {"B200", "RTX 5090"} and not names & {"A100", "H100"}:
        why = "compare the whole (major, minor) tuple with (8, 0): a major version above 9 counts too"
    else:
        why = "bf16 Tensor Cores came with Ampere, compute capability 8.0: True from (8, 0) on"
    listed = ", ".join(f"{n} {c[0]}.{c[1]} should be {ok}" for n, c, ok in wrong[:3])
    return [f"{listed}: {why}"]


register(Exercise(
    id="11.1", notebook="11_ddp_on_gpus", title="bf16 in hardware",
    skills="compute capability; bf16 Tensor Cores from Ampere on; emulation that is_bf16_supported() counts",
    answer="bf16_in_hardware(capability) -> bool, for a (major, minor) tuple",
    nproc=0, on_rank=on_rank, judge=judge))
