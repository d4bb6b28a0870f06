"""benchmarks/report.py never erases measured tables: a table whose results file is missing keeps the text the
report already has, a report without block markers is refused, and each missing table names its command."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def report():
    spec = importlib.util.spec_from_file_location("fp8lm_report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _copy_doc(tmp_path: Path) -> Path:
    doc = tmp_path / "docs" / "results.md"
    doc.parent.mkdir()
    doc.write_text((ROOT / "docs" / "results.md").read_text())
    return doc


def test_missing_results_keep_the_measured_tables(report, tmp_path, capsys):
    doc, results = _copy_doc(tmp_path), tmp_path / "results"
    results.mkdir()
    before = doc.read_text()
    assert report.main(["--out", str(doc), "--results", str(results)]) == 0
    assert doc.read_text() == before  # every table kept, the planner's table regenerated identically
    assert "Not measured yet" not in before
    out = capsys.readouterr().out
    assert "kept the table 'memory' as it was" in out and "`python benchmarks/memory.py`" in out


def test_a_measured_table_is_rewritten_and_the_others_kept(report, tmp_path):
    doc, results = _copy_doc(tmp_path), tmp_path / "results"
    results.mkdir()
    (results / "grad_accumulation.json").write_text(json.dumps({
        "counts": [4, 64], "seeds": 3, "bytes_per_element": {"fp32 sum": 4},
        "relative_error": {"4": {"fp32 sum": 0.0123}, "64": {"fp32 sum": 0.0456}}}))
    before = doc.read_text()
    assert report.main(["--out", str(doc), "--results", str(results)]) == 0
    after = doc.read_text()
    assert "| fp32 sum | 4 | 0.0123 | 0.0456 |" in after
    blocks = lambda text: dict(re.findall(r"<!-- report block: ([\w-]+) -->\n(.*?)<!-- end", text, re.S))
    old, new = blocks(before), blocks(after)
    assert old.keys() == new.keys()
    assert [k for k in old if old[k] != new[k]] == ["grad-accumulation"]


def test_a_report_without_markers_is_refused_not_erased(report, tmp_path, capsys):
    doc, results = _copy_doc(tmp_path), tmp_path / "results"
    results.mkdir()
    legacy = re.sub(r"<!-- (end of )?report block: [\w-]+ -->\n", "", doc.read_text())
    doc.write_text(legacy)
    assert report.main(["--out", str(doc), "--results", str(results)]) == 2
    assert doc.read_text() == legacy
    err = capsys.readouterr().err
    assert "python benchmarks/memory.py" in err and "python benchmarks/report.py --run" in err


def test_a_new_report_names_the_command_of_each_missing_table(report, tmp_path):
    doc, results = tmp_path / "results.md", tmp_path / "results"
    results.mkdir()
    assert report.main(["--out", str(doc), "--results", str(results)]) == 0
    text = doc.read_text()
    assert "_Not measured yet: run `python benchmarks/memory.py` (or `python benchmarks/report.py --run`)._" in text
    assert "`torchrun --nproc_per_node 2 benchmarks/comm.py`" in text
    assert "No GPU was lent" in text  # the GPU section's own text where gpu_step.json is missing
