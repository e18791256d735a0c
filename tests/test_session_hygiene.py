"""What the test session itself leaves behind: nothing in the temp dir, nothing in the learner's grades."""
import os
import subprocess
import sys


def test_a_direct_torchrun_leaves_no_torchelastic_folder_in_the_temp_dir(tmp_path):
    # torchrun makes a torchelastic_* folder for its per-rank logs in the temp dir and never removes it,
    # unless PET_LOG_DIR (its --log-dir) says where: the session sets it (tests/conftest.py)
    assert os.environ.get("PET_LOG_DIR"), "the test session sets PET_LOG_DIR"
    program = tmp_path / "hello.py"
    program.write_text("print('hello')\n")
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                        str(program)], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert not list(temp.glob("torchelastic_*")), sorted(x.name for x in temp.iterdir())
    # ...and without the setting it would have left one there: the check above can fail
    env.pop("PET_LOG_DIR")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                        str(program)], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert list(temp.glob("torchelastic_*"))


def test_the_session_grades_go_to_a_scratch_file():
    path = os.environ.get("DDP_LAB_GRADES", "")
    assert path and not path.startswith(os.path.expanduser("~/.ddp_lab")), path
