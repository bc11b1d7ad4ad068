"""Running the workbook as a course: nbgrader test cells, an nbgrader course folder, and learner progress.

`marks` writes the nbgrader metadata that makes each exercise's check cell a locked, graded test;
`layout` lays out an nbgrader course directory from notebooks/ (`make course`); `progress` re-runs a
learner's answers through the checks (`python -m labkit progress`); `cli` is `python -m labkit course`.
"""

__all__: list[str] = []
