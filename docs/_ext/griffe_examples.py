"""A griffe extension for the API reference: read shardfn's `Example:` sections as examples.

shardfn's docstrings head their doctests `Example:` (STYLE.md); griffe's Google parser
knows only `Examples:` as the section whose `>>>` lines render as code (any other
`Title:` becomes an admonition of markdown text). This renames the header on load, so
the docstrings stay as they are and the doctests render as code.
"""

import re

import griffe

_HEADER = re.compile(r"^(\s*)Example:\s*$", re.M)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _HEADER.sub(r"\1Examples:", obj.docstring.value)
