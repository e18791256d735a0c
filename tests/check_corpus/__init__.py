"""Checker input (training scripts, launch files, a notebook), not tests; see conftest.py here."""
