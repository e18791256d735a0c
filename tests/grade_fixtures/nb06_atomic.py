"""06.5: a right atomic save and the wrong ones, each with the hint it must get."""
import os
import shutil
import tempfile

import torch


def good(obj, path):
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def renames_without_fsync(obj, path):
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def fsyncs_after_the_rename(obj, path):
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def straight_to_the_file(obj, path):
    torch.save(obj, path)


def temporary_in_another_folder(obj, path):
    fd, tmp = tempfile.mkstemp(suffix=".pt")
    os.close(fd)
    torch.save(obj, tmp)
    shutil.move(tmp, path)


def copies_and_leaves_the_temporary(obj, path):
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    shutil.copyfile(tmp, path)


def swallows_the_error(obj, path):
    try:
        good(obj, path)
    except Exception:
        pass


MISTAKES = {
    "saves straight to the file": (straight_to_the_file, "write to a temporary file first"),
    "temporary file in another folder": (temporary_in_another_folder, "only within one file system"),
    "copies and leaves the temporary": (copies_and_leaves_the_temporary, "files left in the folder"),
    "swallows the error": (swallows_the_error, "let the error through"),
    "renames without fsync": (renames_without_fsync, "without os.fsync() first"),
    "fsyncs after the rename": (fsyncs_after_the_rename, "without os.fsync() first"),
}
