"""The package's public surface: `import shardfn` is light, and `sf.testing` is a lazy attribute."""

import subprocess
import sys


def run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_import_shardfn_does_not_import_the_test_helpers():
    out = run_python("import sys, shardfn; print(sorted(m for m in sys.modules if m == 'hypothesis' or "
                     "m.startswith(('hypothesis.', 'shardfn.testing'))))")
    assert out.strip() == "[]"


def test_sf_testing_is_reachable_after_a_plain_import():
    out = run_python("import shardfn as sf; f = sf.testing.assert_ddp_equivalent; import shardfn.testing as t; "
                     "print(f is t.assert_ddp_equivalent, 'testing' in dir(sf), 'testing' in sf.__all__)")
    assert out.split() == ["True", "True", "True"]


def test_an_unknown_attribute_is_an_attribute_error():
    out = run_python("import shardfn as sf\ntry:\n    sf.no_such_name\nexcept AttributeError as e:\n    print(e)")
    assert out.strip() == "module 'shardfn' has no attribute 'no_such_name'"


def test_import_shardfn_does_not_import_transformers_or_safetensors():
    out = run_python("import sys, shardfn; print(sorted(m for m in sys.modules if m.split('.')[0] in "
                     "('transformers', 'safetensors') or m in ('shardfn.hf', 'shardfn._hf')))")
    assert out.strip() == "[]"


def test_sf_hf_is_a_lazy_attribute_that_imports_neither_package():
    out = run_python("import sys, shardfn as sf; f = sf.hf.load_shards; import shardfn.hf as h; "
                     "print(f is h.load_shards, 'hf' in dir(sf), 'hf' in sf.__all__, "
                     "any(m.split('.')[0] in ('transformers', 'safetensors') for m in sys.modules))")
    assert out.split() == ["True", "True", "True", "False"]


def test_sf_nn_is_public():
    out = run_python("import shardfn as sf; print('nn' in sf.__all__, sorted(sf.nn.__all__))")
    assert out.split(" ", 1) == ["True", "['positions', 'ring_attention', 'rotary', 'ulysses_attention', 'unzigzag', "
                                         "'zigzag']\n"]
