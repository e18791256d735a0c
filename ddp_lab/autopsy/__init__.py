"""Why a DDP job hangs: every rank's stack and Flight Recorder entries, turned into one sentence.

    ddp-lab autopsy DIR [--json]     # a folder of per-rank dumps (a cluster job, a SLURM run)

ddp_lab.engine.launch uses it on its own (see docs/autopsy.md):
- _inject/sitecustomize.py  arms each rank through the environment (the program is unchanged);
- collect.py   the launcher's side: the variables, the request to the live ranks, bounded waits;
- evidence.py  reads a folder: Flight Recorder dumps, stacks, torchrun's @record error files;
- diagnose.py  who waits in which collective, who never came;
- patterns.py  the known causes, with the lesson and the `ddp-lab check` rule for each;
- command.py   the `ddp-lab autopsy` subcommand.
This package imports neither torch nor anything heavy: the launcher imports it.
"""
