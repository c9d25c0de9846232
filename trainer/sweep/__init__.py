"""`trainer run-experiments`: a grid of runs shared out over GPU / CPU slots, or one SLURM array job.

- spec: experiments files, grid expansion, names, command lines
- runner: the slot queue and process-group handling of each run
- results: results.json / summary.csv / OUT/<name>/result.json
- slurm: submitit array submission and --collect
"""

from trainer.sweep.results import FINAL_STATUSES, STATUSES, read_final_metrics, read_results
from trainer.sweep.runner import Scheduler, SlotPool, run_experiments
from trainer.sweep.slurm import collect_results, make_executor, run_array_task, slurm_parameters, submit_slurm
from trainer.sweep.spec import (Experiment, ExperimentsError, expand_grid, free_port, load_experiments,
                                      parse_experiments)

__all__ = ["FINAL_STATUSES", "STATUSES", "Experiment", "ExperimentsError", "Scheduler", "SlotPool", "collect_results",
           "expand_grid", "free_port", "load_experiments", "make_executor", "parse_experiments", "read_final_metrics",
           "read_results", "run_array_task", "run_experiments", "slurm_parameters", "submit_slurm"]
