"""`trainer run-experiments`: a grid of runs or a hyperparameter study over GPU / CPU slots, or a SLURM array.

- parsing: what experiments files and `search:` blocks share (`ExperimentsError`, keys, overrides, settings)
- spec: experiments files, grid expansion, names, command lines
- devices: the pool of GPU / CPU slots, GPU memory per process
- processes: one run's process tree: launch in its own session, descendants followed, complete cleanup
- scheduler: the queue, timeouts, Ctrl-C; `run_experiments`
- display: the live status table / event lines
- record: `RunRecord`, one experiment's record; results: results.json / summary.csv / OUT/<name>/result.json
- slurm: submitit array submission and --collect
- searchspec: the `search:` block (no Optuna needed to parse it); study: the Optuna study on the scheduler
  (ask-and-tell trials, pruning by SIGTERM, --resume, confirm, plots, SLURM journal); stats: seed statistics
"""

from trainer.sweep.devices import SlotPool
from trainer.sweep.display import StatusDisplay, render_table
from trainer.sweep.parsing import ExperimentsError
from trainer.sweep.record import FINAL_STATUSES, STATUSES, RunRecord, read_final_metrics
from trainer.sweep.results import read_results
from trainer.sweep.scheduler import INTERRUPTED_EXIT, Scheduler, run_experiments
from trainer.sweep.slurm import collect_results, make_executor, run_array_task, slurm_parameters, submit_slurm
from trainer.sweep.spec import Experiment, expand_grid, free_port, load_experiments, parse_experiments

__all__ = ["FINAL_STATUSES", "INTERRUPTED_EXIT", "STATUSES", "Experiment", "ExperimentsError", "RunRecord",
           "Scheduler", "SlotPool", "StatusDisplay", "collect_results", "expand_grid", "free_port",
           "load_experiments", "make_executor", "parse_experiments", "read_final_metrics", "read_results",
           "render_table", "run_array_task", "run_experiments", "slurm_parameters", "submit_slurm"]
