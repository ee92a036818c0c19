"""The documentation builds, and every example in it runs.

- `mkdocs build --strict` (mkdocs and its plugins are test extras: a missing one fails
  the test with the install command, it does not skip it);
- the doctests of every module of the `shardfn` package, in-process, with
  `pytest --doctest-modules`' defaults (no option flags);
- the ```python blocks of the guide pages (index, getting started, concepts, how-tos,
  design/), each page's blocks in order in one namespace. Convention: a block that cannot
  run here (a torchrun script, a fragment) is fenced ```py instead: it is highlighted the
  same and not executed. The design notes at the top of docs/ (autodiff.md,
  checkpoints.md, fsdp_design.md, optim.md) show fragments and are not executed.
"""

import doctest
import importlib
import importlib.util
import os
import pkgutil
import re
import subprocess
import sys

import pytest

import shardfn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


# -- mkdocs -------------------------------------------------------------------------------


def test_mkdocs_build_strict(tmp_path):
    def installed(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # the parent package of a dotted name is missing
            return False

    missing = [m for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python") if not installed(m)]
    assert not missing, (f"mkdocs build needs {missing}: pip install -e '.[test]' "
                         f"(mkdocs, mkdocs-material, mkdocstrings[python])")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", os.path.join(ROOT, "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert (tmp_path / "site" / "api" / "shard" / "index.html").exists()


# -- doctests of the package ------------------------------------------------------------------


def _own_doctests(module_name: str):
    """The doctests written in this module's file (not in names it re-exports)."""
    module = importlib.import_module(module_name)
    tests = doctest.DocTestFinder().find(module, module_name)
    mine = os.path.realpath(module.__file__)
    return [t for t in tests if t.examples and t.filename and os.path.realpath(t.filename) == mine]


def _modules_with_doctests() -> list:
    params = []
    broken = []  # walk_packages would otherwise skip a subpackage that fails to import, silently
    walked = pkgutil.walk_packages(shardfn.__path__, prefix="shardfn.", onerror=broken.append)
    for name in ["shardfn"] + sorted({i.name for i in walked} | set(broken)):
        try:
            if _own_doctests(name):
                params.append(name)
        except ImportError:  # a module that does not import is a failure: test_doctests re-raises
            params.append(name)
    return params


@pytest.mark.parametrize("module_name", _modules_with_doctests())
def test_doctests(module_name):
    tests = _own_doctests(module_name)
    runner = doctest.DocTestRunner(optionflags=0)
    failures = []
    for test in tests:
        out = []
        result = runner.run(test, out=out.append)
        if result.failed:
            failures.append(f"{test.name} (line {test.lineno}):\n" + "".join(out))
    assert not failures, "doctest failures:\n\n" + "\n\n".join(failures)


# -- code blocks of the docs pages ----------------------------------------------------------


NOT_EXECUTED = {"autodiff.md", "checkpoints.md", "fsdp_design.md", "optim.md"}  # design notes: fragments


def _pages() -> list[str]:
    pages = []
    for directory, _, files in os.walk(DOCS):
        for name in files:
            if name.endswith(".md") and os.path.relpath(os.path.join(directory, name), DOCS) not in NOT_EXECUTED:
                path = os.path.join(directory, name)
                with open(path, encoding="utf-8") as f:
                    if "```python\n" in f.read():
                        pages.append(os.path.relpath(path, DOCS))
    return sorted(pages)


@pytest.mark.parametrize("page", _pages())
def test_docs_code_blocks_run(page, capsys):
    with open(os.path.join(DOCS, page), encoding="utf-8") as f:
        text = f.read()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    namespace = {"__name__": f"docs.{page}"}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"docs/{page} (python block {i + 1})", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"docs/{page}: python block {i + 1} raised {type(e).__name__}: {e}\n\n{block}") from e
