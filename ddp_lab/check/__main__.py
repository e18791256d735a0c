"""python -m ddp_lab.check PATH...  (the same as `ddp-lab check PATH...`)"""
import sys

from .report import main

sys.exit(main())
