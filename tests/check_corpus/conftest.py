# The files here are input for tests/test_check_*.py, not tests: pytest and nbval must not collect
# them (the notebook would be executed). This folder is a package so that this file is imported as
# check_corpus.conftest and does not shadow tests/conftest.py.
collect_ignore_glob = ["*"]
