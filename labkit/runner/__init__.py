"""Running the workbook's notebooks from the command line: reruns, sweeps, the workbook run, refreshes.

`python -m labkit repro` reruns one reproduction with validated parameters (papermill, a timeout,
results under `runs/`); `make workbook` runs them all and writes a summary; `make notebooks`
refreshes the committed outputs. The notebooks themselves need only `labkit.repro.setup`.

- `rerun_parameters`: the parameters cell read from the file, and a rerun's values checked against it;
- `run`: one papermill run in a child process (`run_notebook`);
- `paths`: fresh run folders, safe folder names, the proof that a written path is inside its run folder;
- `processes`: stopping a whole process tree on any platform; SIGTERM handled as Ctrl-C;
- `sweeps`: a grid of runs, tabulated and plotted;
- `cluster`: a sweep's points on a Dask cluster (`--cluster`; the `cluster` extra, imported only when asked for);
- `summary`: the workbook run's summary files;
- `execute`: executing a committed notebook in place;
- `repro_command`: `python -m labkit repro` (one rerun, or a sweep);
- `normalise_command`: `python -m labkit normalise` (imports no torch: the pre-commit hook runs it);
- `cli`: the other commands (`workbook`, `execute`).
"""

from labkit._lazy import lazy_attributes

# Read lazily (PEP 562), so `python -m labkit normalise` imports only what normalising needs: no torch.
_HOMES = {
    "cluster_sweep": "labkit.runner.cluster",
    "parse_cluster": "labkit.runner.cluster",
    "execute_in_place": "labkit.runner.execute",
    "execute_main": "labkit.runner.cli",
    "normalise_main": "labkit.runner.normalise_command",
    "workbook_main": "labkit.runner.cli",
    "repro_main": "labkit.runner.repro_command",
    "notebook_parameters": "labkit.runner.rerun_parameters",
    "parameters_cell": "labkit.runner.rerun_parameters",
    "parse_value": "labkit.runner.rerun_parameters",
    "validate_parameters": "labkit.runner.rerun_parameters",
    "RunResult": "labkit.runner.run",
    "resolve_notebook": "labkit.runner.run",
    "run_notebook": "labkit.runner.run",
    "write_summary": "labkit.runner.summary",
    "MAX_POINTS": "labkit.runner.sweeps",
    "check_point_count": "labkit.runner.sweeps",
    "grid_points": "labkit.runner.sweeps",
    "parse_sweep": "labkit.runner.sweeps",
    "plot_sweep": "labkit.runner.sweeps",
    "sweep": "labkit.runner.sweeps",
    "sweep_table": "labkit.runner.sweeps",
    "write_sweep": "labkit.runner.sweeps",
}
__getattr__, __dir__ = lazy_attributes(__name__, _HOMES)

__all__ = sorted(_HOMES)
