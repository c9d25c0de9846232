"""A third-party family: predicts the mean of a vector, registered without editing trainer.

`spec.py` (no torch) is what the `trainer.tasks` entry point names: `trainer tasks`, config-help and
config errors read it alone; `task.py` (torch) is imported when a run needs the task."""
