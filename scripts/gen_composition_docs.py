"""Regenerate the table in docs/composition.md from shardfn/_fsdp/support.py.

Run: python scripts/gen_composition_docs.py  (tests/fsdp/test_composition.py checks the page.)
"""

import pathlib
import re

from shardfn._fsdp import support

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "composition.md"
BEGIN, END = "<!-- table: begin (generated) -->", "<!-- table: end -->"

text = PAGE.read_text()
block = f"{BEGIN}\n{support.markdown()}{END}"
text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
PAGE.write_text(text)
print(f"wrote {PAGE}")
