"""A run from the command line to its files: the entry point (`entry.py`), the pre-flight, the training run
(`train.py`), the one assembly of trainer, module and data module (`build.py`), reports, loggers and sweeps."""
