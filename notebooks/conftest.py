"""The notebooks run under nbmake from their .ipynb; their jupytext .py sources are not test
modules (with --doctest-modules pytest would import, i.e. run, them a second time)."""

collect_ignore_glob = ["*.py"]
