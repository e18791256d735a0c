"""The CPUs each worker may run on: every worker prints one line. Notebook 10 runs it under SLURM,
through scripts/slurm_ddp.sbatch with this program in place of train_ddp.py.

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb10_cpus

A worker runs on the CPUs of its affinity mask, inherited from torchrun, which inherits it from the
task SLURM started (os.cpu_count() counts the machine's CPUs, not these). Standard library only, and
no process group: it starts in a fraction of a second.
"""
import argparse
import os
import socket
import sys


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))   # the CPUs this process may run on
    line = (f"{socket.gethostname()} rank {os.environ.get('RANK', '0')}: {len(cpus)} CPU{'s' * (len(cpus) > 1)} "
            f"{cpus}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}\n")
    sys.stdout.write(line)   # one write, newline included: the node's workers share one output stream
    sys.stdout.flush()


if __name__ == "__main__":
    main()
