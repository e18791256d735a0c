"""Cannot run: the data file it needs is not there (verify exits 2 and says why)."""
import torch.distributed as dist

dist.init_process_group("gloo")
with open("data/train.bin", "rb") as f:  # relative to the working directory: verify's scratch folder
    f.read()
