"""Each notebook has one metadata block, notebooks/meta/NN_name.toml, its fields are true of the notebook,
and the files generated from the blocks are current (labkit/_notebook_meta.py says what is generated).

Everything here reads files (the blocks, the py twins, the stored notebooks); nothing is executed.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from labkit import _notebook_meta as meta_module
from labkit import claims, claims_report, notebooks
from labkit.errors import LabkitError

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = notebooks.workbook_notebooks(ROOT / "notebooks")
META = meta_module.all_meta()
STEMS = [path.stem for path in NOTEBOOKS]


@pytest.fixture(params=STEMS)
def meta(request):
    assert request.param in META, f"notebooks/meta/{request.param}.toml is missing: every notebook has one block"
    return META[request.param]


def parameters_cell_source(notebook: Path) -> str:
    (cell,) = [cell for cell in nbformat.read(notebook, 4).cells if "parameters" in cell.metadata.get("tags", [])]
    return cell.source


def stored_verdicts(notebook: Path) -> dict[str, set[str]]:
    """Case -> the verdicts the notebook stored (made on a CPU: the stored outputs are CPU runs)."""
    verdicts: dict[str, set[str]] = {}
    for record in claims_report.collect([notebook]):
        verdicts.setdefault(record["id"], set()).add(record["verdict"])
    return verdicts


# ---- one block per notebook, one notebook per block ------------------------------------------------


def test_every_notebook_has_one_block_and_every_block_a_notebook():
    assert STEMS, "no notebooks found"
    assert list(META) == STEMS, (f"blocks without a notebook: {sorted(set(META) - set(STEMS))}; "
                                 f"notebooks without a block: {sorted(set(STEMS) - set(META))}")
    strays = [path.name for path in meta_module.META.iterdir() if path.suffix != ".toml"]
    assert strays == [], f"notebooks/meta/ holds only NN_name.toml blocks: {strays}"


def test_the_notebook_holds_no_second_block_in_its_own_metadata():
    # One place: a `labkit` key in the .ipynb's metadata would be a second source for the same facts.
    holding = [path.name for path in NOTEBOOKS if "labkit" in nbformat.read(path, 4).metadata]
    assert holding == []


# ---- each field is true of its notebook --------------------------------------------------------------


def test_named_cases_are_catalogued_and_checked_by_this_notebook(meta):
    recorded = set(stored_verdicts(meta.notebook))
    named = {*meta.needs_gpu_on_cpu, *meta.typed_numbers_allowed,
             *(case_id for entry in meta.troubleshooting for case_id in entry.cases)}
    assert named - set(claims.catalogue()) == set(), "IDs that are not in labkit/data/cases.json"
    assert named - recorded == set(), f"{meta.stem} stores no verdict for these cases: move them to the block of " \
                                      "the notebook that checks them"


def test_the_catalogue_plans_each_recorded_case_in_this_notebook(meta):
    # cases.json's families name their notebooks; a case checked elsewhere is a catalogue out of step.
    family_notebooks = {letter: family["notebooks"] for letter, family in claims.families().items()}
    elsewhere = [case_id for case_id in stored_verdicts(meta.notebook)
                 if meta.stem not in family_notebooks[claims.case(case_id).family]]
    assert elsewhere == [], f"cases.json's families do not list {meta.stem} for {elsewhere}"


def test_needs_gpu_on_cpu_cases_stored_exactly_needs_gpu(meta):
    verdicts = stored_verdicts(meta.notebook)
    measured = {case_id: verdicts[case_id] for case_id in meta.needs_gpu_on_cpu
                if verdicts.get(case_id) != {"needs-gpu"}}
    assert measured == {}, "the stored (CPU) outputs measured these cases: take them out of needs_gpu_on_cpu"


def test_every_case_stored_as_needs_gpu_is_listed(meta):
    needs_gpu = {case_id for case_id, verdicts in stored_verdicts(meta.notebook).items() if "needs-gpu" in verdicts}
    assert needs_gpu - set(meta.needs_gpu_on_cpu) == set(), "add these to needs_gpu_on_cpu"


def test_gpu_sections_are_declared_exactly_where_the_twin_branches_on_cuda(meta):
    branches = meta_module.cuda_lines(meta.twin)
    if branches:
        assert meta.gpu_sections, f"{meta.twin.name} has {branches} lines of CUDA-only code: describe them in " \
                                  "gpu_sections (the GPU runner's list and the README's GPU column come from it)"
    else:
        assert not meta.gpu_sections, f"{meta.twin.name} has no CUDA branch: gpu_sections must be empty"
        assert not meta.needs_gpu_on_cpu, "a case that needs a GPU needs a GPU section"


def test_the_opening_gives_the_reading_time_its_main_path_takes(meta):
    said = meta_module.opening(meta.notebook).reading_minutes
    estimated = meta_module.estimated_reading_minutes(meta.notebook)
    assert said == estimated, (f"{meta.notebook.name} says about {said} min to read and run; its main path reads in "
                               f"about {estimated} (labkit/_notebook_meta.py): correct its **Time:** line")


def test_typed_numbers_allowed_are_still_typed_into_their_case(meta):
    # A stale allowance would let a measurement be typed in later unnoticed.
    import test_claim_evidence

    typed = {case_id: set() for case_id in meta.typed_numbers_allowed}
    for node in test_claim_evidence.claim_checks(meta.twin):
        if node.args[0].value in typed:
            typed[node.args[0].value] |= set(test_claim_evidence.typed_numbers(node))
    unused = {case_id: sorted(set(entry.numbers) - typed[case_id])
              for case_id, entry in meta.typed_numbers_allowed.items() if set(entry.numbers) - typed[case_id]}
    assert unused == {}, f"{meta.stem}: allowed typed numbers no evidence types any more: remove them"


def test_troubleshooting_symptoms_are_written_the_same_wherever_they_repeat():
    # A symptom shared by notebooks is one row of the index only when its words are the same in each block.
    seen: dict[str, str] = {}
    for stem, meta in META.items():
        for entry in meta.troubleshooting:
            key = re.sub(r"\W+", " ", entry.symptom.lower()).strip()
            assert seen.setdefault(key, entry.symptom) == entry.symptom, f"{stem} words a shared symptom differently"


# ---- reading a block ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "says"), [
    ('gpu_sections = ""\n', "missing field 'needs_gpu_on_cpu'"),
    ('gpu_sections = ""\nneeds_gpu_on_cpu = []\ngpu = 1\n', "unknown field(s) ['gpu']"),
    ('gpu_sections = []\nneeds_gpu_on_cpu = []\n', "gpu_sections must be a TOML str"),
    ('gpu_sections = ""\nneeds_gpu_on_cpu = []\n[typed_numbers_allowed]\nA1 = { numbers = "2" }\n',
     "with a reason"),
    ('gpu_sections = ""\nneeds_gpu_on_cpu = []\n[[troubleshooting]]\nsymptom = "x"\n',
     'symptom = "..." and cases = [...]'),
    ("gpu_sections = \n", "is not valid TOML"),
])
def test_an_invalid_block_is_refused_naming_the_field(tmp_path, text, says):
    path = tmp_path / "99_example.toml"
    path.write_text(text)
    with pytest.raises(LabkitError) as refused:
        meta_module.read(path)
    assert says in str(refused.value) and "99_example.toml" in str(refused.value)


# ---- the generated files --------------------------------------------------------------------------------


def test_the_generated_files_are_current():
    stale = [path.relative_to(ROOT).as_posix() for path in meta_module.stale()]
    assert stale == [], f"stale: {stale}; run `{meta_module.REGENERATE}`"


def test_the_runner_list_is_the_notebooks_with_gpu_sections_most_cuda_code_first():
    lines = [line for line in meta_module.GPU_NOTEBOOKS.read_text().splitlines() if not line.startswith("#")]
    listed = " ".join(lines).split()
    with_gpu = {stem[:2]: meta for stem, meta in META.items() if meta.gpu_sections}
    assert sorted(listed) == sorted(with_gpu)
    sizes = [meta_module.cuda_lines(with_gpu[number].twin) for number in listed]
    assert sizes == sorted(sizes, reverse=True)


def test_the_gpu_runner_reads_its_default_list_from_the_generated_file():
    runner = (ROOT / ".ci" / "gpu-runner").read_text()
    (default,) = re.findall(r"^NOTEBOOKS=\$\{NOTEBOOKS:-(.*)\}$", runner, flags=re.M)
    assert ".ci/gpu-notebooks.txt" in default and not re.search(r"\b\d\d\b", default), default


def test_a_stale_block_is_caught():
    text = "a\n<!-- generated: table (x) -->\nold\n<!-- end: table -->\nb\n"
    assert meta_module.replace_block(text, "table", "new") == "a\n<!-- generated: table (x) -->\nnew\n<!-- end: table -->\nb\n"
    with pytest.raises(LabkitError, match="exactly one"):
        meta_module.replace_block("no markers", "table", "new")


@pytest.mark.parametrize(("ids", "text"), [
    (["A1", "A1b", "A1c", "A2", "A3", "A4"], "A1, A1b, A1c, A2–A4"),
    (["K1", "K2", "K8"], "K1, K2, K8"),
    (["O1", "O2", "O2b", "O3"], "O1, O2, O2b, O3"),
    (["M1"], "M1"),
])
def test_case_lists_become_ranges_of_three_or_more(ids, text):
    assert meta_module.compress_cases(ids) == text
