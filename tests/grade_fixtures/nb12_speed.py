"""12.2: the timed check's negative controls. Each answer's communication cannot overlap backward,
so the verdict is decided before any timing (a right answer's verdict is a timing: its rules are
tested on given ratios in tests/test_grade.py)."""
import torch.distributed as dist

from grade_fixtures.nb12_ddp import AfterBackward, MyDDP, WaitsInHook

EID = "12.2"
good = MyDDP


class BlocksInHook(MyDDP):
    def _issue(self, flat):
        dist.all_reduce(flat)
        return _Done()


class _Done:
    def wait(self):
        return True


MISTAKES = {
    "all-reduces after backward": (AfterBackward, "it issued no all_reduce during backward"),
    "waits inside the hook": (WaitsInHook, "it waited for an all-reduce during backward"),
    "blocks inside the hook": (BlocksInHook, "without async_op=True during backward"),
}
