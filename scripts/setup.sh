#!/usr/bin/env bash
# Install what the demo and the tests need; idempotent, and fast once done.
#
# 1. torch: if it is missing, pin 2.13.0 (the CPU wheel this machine has on disk);
#    an unpinned `pip install torch` pulls a multi-GB CUDA build.
# 2. shardfn itself, editable, with the test extras, only when the stamp differs:
#    the stamp holds pyproject.toml's hash and this checkout's path, and the check
#    also finds shardfn from outside the repo to see that the install points here.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd -P)"
PY="${PYTHON:-python3}"
STAMP="$ROOT/build/.setup-stamp"

# find_spec, not `import torch`: same answer here, without the 1.5 s import.
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
    echo "setup: installing torch==2.13.0"
    "$PY" -m pip install "torch==2.13.0"
fi

want="$( (sha256sum pyproject.toml | cut -d' ' -f1; echo "$ROOT") | sha256sum | cut -d' ' -f1)"
have="$(cat "$STAMP" 2>/dev/null || true)"

installed_here() {
    # From / so that this checkout on sys.path cannot mask a missing install; find_spec
    # locates the packages without importing them (importing torch takes seconds).
    (cd / && "$PY" - "$ROOT" <<'PYEOF'
import importlib.util, os, sys
for name in ("torch", "optree", "numpy", "hypothesis", "pytest", "pytest_timeout", "xdist", "matplotlib", "tqdm",
             "mkdocs", "mkdocstrings", "material", "nbclient", "nbformat", "ipykernel",
             "transformers", "safetensors"):
    if importlib.util.find_spec(name) is None:
        sys.exit(1)
spec = importlib.util.find_spec("shardfn")
root = os.path.realpath(sys.argv[1])
ok = spec is not None and os.path.realpath(spec.origin) == os.path.join(root, "shardfn", "__init__.py")
sys.exit(0 if ok else 1)
PYEOF
    ) >/dev/null 2>&1
}

if [[ "$want" == "$have" ]] && installed_here; then
    exit 0
fi

echo "setup: pip install -e .[test]"
"$PY" -m pip install -e ".[test]"
installed_here || { echo "setup: shardfn does not import from $ROOT after the install" >&2; exit 1; }
mkdir -p "$(dirname "$STAMP")"
echo "$want" > "$STAMP"
echo "setup: done"
