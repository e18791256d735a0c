"""`ddp-lab verify`: run your own training script on CPU ranks and check it is DDP-correct.

    from ddp_lab.verify import verify
    report = verify("train.py", args=["--epochs", "2"], steps=3)
    report.findings      # [Finding(category, rank, step, message, evidence, fix)]

The script runs unchanged; what it does is observed from inside each rank (see
ddp_lab/verify/_inject/sitecustomize.py) and compared across ranks by ddp_lab.verify.findings.
"""
from ddp_lab.verify.findings import Finding  # noqa: F401
from ddp_lab.verify.runner import Report, verify  # noqa: F401
