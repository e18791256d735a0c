"""The survey article's DataLoader knobs, measured (notebook 02); the measurement is ddp_lab.lessons.loading.

    python -m ddp_lab.experiments.nb02_loader      # prints the table; no launch needed

One process, no process group: the loader's worker processes are the point. Every configuration
in loading.CONFIGS reads the same slow dataset for loading.EPOCHS epochs while a stand-in
training step sleeps; the table gives total seconds, the first batch of each epoch and how many
processes did the loading.
"""
from __future__ import annotations

import argparse

from ddp_lab.lessons import loading


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    print(f"serial estimate {loading.serial_estimate_s():.2f} s")
    for r in loading.measure_all():
        print(f"{r['config']:>22}: {r['total_s']:.2f} s, first batch per epoch "
              f"{[round(s, 3) for s in r['first_batch_s']]}, loader processes {len(r['loader_pids'])}")
    print("pin_memory:", loading.pinned_copy_gbps() or "no CUDA here: pinned memory only speeds host-to-GPU copies")


if __name__ == "__main__":
    main()
