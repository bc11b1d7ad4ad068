"""Running the workbook's notebooks from the command line: reruns, sweeps, the workbook run, refreshes.

`python -m labkit repro` reruns one reproduction with validated parameters (papermill, a timeout,
results under `runs/`); `make workbook` runs them all and writes a summary; `make notebooks`
refreshes the committed outputs. The notebooks themselves need only `labkit.repro.setup`.

- `rerun_parameters`: the parameters cell read from the file, and a rerun's values checked against it;
- `run`: one papermill run in a child process (`run_notebook`);
- `paths`: fresh run folders, safe folder names, the proof that a written path is inside its run folder;
- `processes`: stopping a whole process tree on any platform; SIGTERM handled as Ctrl-C;
- `sweep`: a grid of runs, tabulated and plotted;
- `cluster`: a sweep's points on a Dask cluster (`--cluster`; the `cluster` extra, imported only when asked for);
- `summary`: the workbook run's summary files;
- `execute`: executing a committed notebook in place;
- `repro_command`: `python -m labkit repro` (one rerun, or a sweep);
- `cli`: the other commands (`workbook`, `execute`, `normalise`).
"""

from labkit.runner.cli import execute_main, normalise_main, workbook_main
from labkit.runner.cluster import cluster_sweep, parse_cluster
from labkit.runner.execute import execute_in_place
from labkit.runner.repro_command import repro_main
from labkit.runner.rerun_parameters import notebook_parameters, parameters_cell, parse_value, validate_parameters
from labkit.runner.run import RunResult, resolve_notebook, run_notebook
from labkit.runner.summary import write_summary
from labkit.runner.sweep import grid_points, parse_sweep, plot_sweep, sweep, sweep_table, write_sweep

__all__ = [
    "RunResult",
    "cluster_sweep",
    "execute_in_place",
    "execute_main",
    "grid_points",
    "normalise_main",
    "notebook_parameters",
    "parameters_cell",
    "parse_cluster",
    "parse_sweep",
    "parse_value",
    "plot_sweep",
    "repro_main",
    "resolve_notebook",
    "run_notebook",
    "sweep",
    "sweep_table",
    "validate_parameters",
    "workbook_main",
    "write_summary",
    "write_sweep",
]
