"""Notebook 07, deep dive on torchrun's error_file: what torchrun's failure summary shows, with
and without @record.

    torchrun --standalone --nproc_per_node=1 -m ddp_lab.experiments.nb07_record
    torchrun --standalone --nproc_per_node=1 -m ddp_lab.experiments.nb07_record --record

The program fails in a helper, as a typo in a config key would. Without @record, torchrun's
summary says `error_file: <N/A>` and points at a web page; the traceback went to the worker's
stderr only (lost among the ranks' output on a big job). With @record on main(), the worker
writes the exception to the file torchrun names in TORCHELASTIC_ERROR_FILE and torchrun puts
the traceback in its summary.
"""
import argparse
import sys

from torch.distributed.elastic.multiprocessing.errors import record


def load_config():
    config = {"lr": 0.1}
    return config["learning_rate"]          # the bug: a key that is not there


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--record", action="store_true", help="run main() decorated with @record")
    parser.parse_args(argv)
    load_config()


if __name__ == "__main__":
    # In a real program main() is always decorated (`@record` above `def main`). Here the flag
    # picks, so one file shows both summaries; it is read before main() runs because @record
    # wraps main() itself. main() parses it again, with the rest of its arguments.
    (record(main) if "--record" in sys.argv[1:] else main)()
