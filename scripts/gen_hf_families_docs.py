"""Write the families x features table (tests/hf/hf_families.py) into docs/howto/transformers.md.

Run: python scripts/gen_hf_families_docs.py          (tests/hf/test_hf_families.py checks the page)
     python scripts/gen_hf_families_docs.py --run    (also runs every cell and prints what it met;
                                                      exits 1 when a cell disagrees with the table)
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from hf import hf_families as H  # noqa: E402

PAGE = ROOT / "docs" / "howto" / "transformers.md"

text = PAGE.read_text()
block = f"{H.BEGIN}\n{H.markdown()}{H.END}"
if H.BEGIN not in text:
    raise SystemExit(f"{PAGE} has no {H.BEGIN!r} marker")
text = re.sub(re.escape(H.BEGIN) + ".*?" + re.escape(H.END), lambda _: block, text, flags=re.S)
PAGE.write_text(text)
print(f"wrote {PAGE}")

if "--run" in sys.argv:
    wrong = 0
    for family in H.FAMILIES:
        for feature in H.CELLS:
            error = H.run_cell(family, feature)
            want = H.TABLE[(family, feature)]
            ok = error is None if want.startswith("yes") else (error or "").startswith(H.EXPECTED_ERRORS[(family, feature)])
            wrong += not ok
            print(f"{'ok ' if ok else 'BAD'} {family:10s} {feature:15s} table: {want[:40]:40s} met: {error or 'held'}")
    sys.exit(1 if wrong else 0)
