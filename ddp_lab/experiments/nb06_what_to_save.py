"""What a checkpoint must hold (notebook 06); the experiment is ddp_lab.lessons.checkpointing.parts.

    python -m ddp_lab.experiments.nb06_what_to_save      # one process, about a second

Trains a small digits model straight through, and again resumed from a checkpoint with each
part (model, optimizer, scheduler, scaler, epoch + step, RNG) left out in turn; prints the
checkpoint's keys and, per part left out, how far the resumed weights end from the straight run's.
"""
from __future__ import annotations

import argparse

from ddp_lab.lessons.checkpointing import parts as checkpoint_parts


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    result = checkpoint_parts.leave_one_out()
    print(f"checkpoint keys: {result['keys']} ({result['size_bytes']} bytes)")
    for name, diff in result["max_abs_diff"].items():
        print(f"left out {name:>13}: max |w_resumed - w_straight| = {diff:.3g}")


if __name__ == "__main__":
    main()
