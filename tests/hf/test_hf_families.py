"""The families x features table of docs/howto/transformers.md, checked cell by cell
(tests/hf/hf_families.py holds the cases and the table): a "yes" cell must hold, a "no" cell
must fail with its recorded error; the page holds the table as
scripts/gen_hf_families_docs.py writes it."""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("transformers")

from hf import hf_families as H  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
CELLS = [(f, feature) for f in H.FAMILIES for feature in H.CELLS]
LEAN = {("llama", "remat training"), ("t5", "estimate"), ("gpt_neox", "load / export"), ("bert", "sharded init"),
        ("llama", "CP"), ("llama", "PP"), ("phi3", "sf.jit")}  # the new features' cheapest "yes" cells (0.2, 0.1, 5 s)


def _marks(cell):
    return [pytest.mark.slow] + ([pytest.mark.ci] if cell in LEAN else [])


@pytest.mark.parametrize("family, feature", [pytest.param(*c, marks=_marks(c)) for c in CELLS],
                         ids=[f"{f}-{feature.replace(' / ', '-').replace(' ', '_')}" for f, feature in CELLS])
def test_cell(family, feature):
    error = H.run_cell(family, feature)
    if H.TABLE[(family, feature)].startswith("yes"):
        assert error is None, error
    else:
        assert error is not None and error.startswith(H.EXPECTED_ERRORS[(family, feature)]), error


def test_every_cell_is_in_the_table():
    assert set(H.TABLE) == {(f, feature) for f in H.FAMILIES for feature in H.FEATURES}
    assert all(v.startswith(("yes", "no: ")) for v in H.TABLE.values())  # every cell run: none "not tested"
    assert set(H.CELLS) == set(H.FEATURES)
    assert {k for k, v in H.TABLE.items() if v.startswith("no: ")} == set(H.EXPECTED_ERRORS)


def test_the_page_holds_the_table():
    page = (ROOT / "docs/howto/transformers.md").read_text()
    assert H.BEGIN in page and H.END in page, "run python scripts/gen_hf_families_docs.py"
    now = page.split(H.BEGIN)[1].split(H.END)[0].strip("\n") + "\n"
    assert now == H.markdown(), "docs/howto/transformers.md is not the table: run python scripts/gen_hf_families_docs.py"
