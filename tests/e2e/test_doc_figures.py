"""The docs' cheap figures (bytes per parameter, planned GiB) equal what the code computes now
(benchmarks/doc_figures.py): a changed default that moves a figure fails here until the docs are regenerated with
``python benchmarks/doc_figures.py --write``."""

from __future__ import annotations

import pytest

from benchmarks import doc_figures


def test_blocks_are_found_replaced_and_checked(tmp_path):
    (tmp_path / "doc.md").write_text("a\n<!-- doc-figures: x -->\nold\n<!-- /doc-figures: x -->\nb\n")
    blocks = {"x": ("doc.md",), "y": ("doc.md",)}
    stale = doc_figures.stale_blocks({"x": "new", "y": "z"}, root=tmp_path, blocks=blocks)
    assert stale == ["doc.md: block x differs from the code", "doc.md: no block y (add the markers "
                     "<!-- doc-figures: y --> ... <!-- /doc-figures: y -->)"]
    doc_figures.write({"x": "new"}, root=tmp_path, blocks=blocks)
    assert doc_figures.stale_blocks({"x": "new"}, root=tmp_path, blocks=blocks) == []
    assert (tmp_path / "doc.md").read_text() == "a\n<!-- doc-figures: x -->\nnew\n<!-- /doc-figures: x -->\nb\n"


@pytest.mark.parametrize("name", sorted(doc_figures.FIGURES))
def test_docs_show_the_figures_the_code_computes(name):
    stale = doc_figures.stale_blocks(doc_figures.render([name]))
    assert not stale, "\n".join(stale) + "\nregenerate: python benchmarks/doc_figures.py --write"
