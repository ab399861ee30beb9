"""The user's entry stays short and current: the README within 250 lines and every docs/ page
it links to present; docs/flags.md is what the parser says today."""

from __future__ import annotations

import importlib.util
import re

from tests.conftest import ROOT


def test_flags_reference_is_current():
    spec = importlib.util.spec_from_file_location("flags_doc", ROOT / "tools" / "flags_doc.py")
    flags_doc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flags_doc)
    text = flags_doc.flags_markdown()
    assert "`--plan-candidates`" in text and "`--tensor-model-parallel-size`" in text
    assert (ROOT / "docs" / "flags.md").read_text() == text, "run python tools/flags_doc.py"


def test_readme_is_short_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "make demo" in readme and "make test" in readme
    links = re.findall(r"\]\(((?:docs|examples|tools)/[^)#]+)", readme)
    assert len(links) >= 6
    for link in links:
        assert (ROOT / link).exists(), link
