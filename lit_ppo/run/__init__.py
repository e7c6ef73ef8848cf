"""A run from the command line to its files: the entry point (`entry.py`), the run prepared once (`prepare.py`: the
pre-flight, the prompts read, the plan), the training run (`train.py`), the one assembly of trainer, module and data
module (`build.py`), reports, loggers and sweeps."""
