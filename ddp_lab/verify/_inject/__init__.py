"""Injected into the ranks of a `ddp-lab verify` run (see sitecustomize.py)."""
