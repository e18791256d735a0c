"""The writer that kill_mid_save starts and kills: python -m ddp_lab.lessons.checkpointing MODE PATH STEP MB PAUSE_AT."""
import sys

from ddp_lab.lessons.checkpointing import _PausingFile, atomic_save, demo_checkpoint, naive_save

mode, target, step, megabytes, pause_at = sys.argv[1:6]
save = naive_save if mode == "naive" else atomic_save
save(demo_checkpoint(int(step), float(megabytes)), target,
     opener=lambda p, m: _PausingFile(p, m, int(pause_at)))
print("DONE", flush=True)
