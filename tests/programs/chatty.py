"""Output that is hard to show: many lines, or lines that do not end in a newline.

    chatty.py many N    every rank prints N numbered lines as fast as it can
    chatty.py partial   rank 0 prints whole lines on stdout and stderr; meanwhile rank 1
                        shows an input() prompt and a progress bar redrawn with "\\r"
                        (as tqdm does, on stderr), neither ending in a newline for a while
No process group: this is about output only.
"""
import os
import sys
import time

rank = int(os.environ["RANK"])
mode = sys.argv[1]
if mode == "many":
    for i in range(int(sys.argv[2])):
        print(f"line {rank} {i}")
elif mode == "partial" and rank == 0:
    for i in range(25):
        print(f"step {i}", flush=True)
        print(f"check {i}", file=sys.stderr, flush=True)
        time.sleep(0.1)
elif mode == "partial":
    time.sleep(0.3)
    try:
        input("name? ")  # stdin is not a terminal: the prompt is written, then EOFError
    except EOFError:
        time.sleep(0.6)  # the prompt sits without a newline while rank 0 goes on
        print("no input")
    for percent in (10, 20, 30):
        sys.stderr.write(f"\r{percent}%|{'#' * (percent // 10)}")
        sys.stderr.flush()
        time.sleep(0.3)
    sys.stderr.write("\n")
