"""Benchmarks, each run as a script: `python bench/NAME.py --help`. A package only so that
import-linter covers it (pyproject [tool.importlinter])."""
