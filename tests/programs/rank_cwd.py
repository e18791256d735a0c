"""Runs a script with each rank in its own working directory, so a relative path such as
--ckpt-dir ck names a folder on rank 0 that rank 1 does not have: a node without the shared
filesystem (the same path, another disk).

    RANK_CWDS=DIR0:DIR1 torchrun ... rank_cwd.py SCRIPT ARGS...
"""
import os
import runpy
import sys

os.chdir(os.environ["RANK_CWDS"].split(os.pathsep)[int(os.environ["RANK"])])
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
