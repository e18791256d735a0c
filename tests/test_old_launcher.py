"""torch.distributed.launch is deprecated in favour of torchrun: torch itself says so when the old
launcher starts. Called in-process with `--help`, so nothing is launched (the warning is raised
before the arguments are parsed); `python -m torch.distributed.launch ...` runs the same `main`."""
import warnings

import torch.distributed.launch
import torch.distributed.run


def _start(main) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            main(["--help"])
        except SystemExit as done:  # argparse exits after printing the help (torchrun's @record returns)
            assert done.code == 0
    return list(caught)


def test_old_launcher_warns_it_is_deprecated_and_names_torchrun(capsys):
    caught = [w for w in _start(torch.distributed.launch.main) if issubclass(w.category, FutureWarning)]
    assert caught, "torch.distributed.launch started without a FutureWarning"
    text = str(caught[0].message)
    assert "torch.distributed.launch is deprecated" in text
    assert "Use torchrun" in text
    assert "--nproc-per-node" in capsys.readouterr().out.replace("_", "-")  # it did reach its parser


def test_torchrun_starts_without_a_deprecation_warning(capsys):
    caught = _start(torch.distributed.run.main)
    assert not [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert "--nproc-per-node" in capsys.readouterr().out
