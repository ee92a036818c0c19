"""The package's public surface: `import shardfn` is light, and `sf.testing` is a lazy attribute."""

import ast
import inspect
import pathlib
import subprocess
import sys
import textwrap

import shardfn


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


# -- layering: data flows one way (DESIGN.md's layout), checked on the source's imports ---

PACKAGE = pathlib.Path(shardfn.__file__).parent

# (modules, packages none of them may import); a name covers its submodules. Imports inside
# functions count too: a lazy import is still a dependency.
LAYERS = [
    # the generic helpers under the transforms: the params view, eager grad, mesh binding
    (("shardfn._params_view", "shardfn._autodiff", "shardfn._binding"),
     ("shardfn._collectives", "shardfn._shard_map", "shardfn._fsdp", "shardfn._remat", "shardfn._functional",
      "shardfn._pipeline", "shardfn.optim", "shardfn._hf", "shardfn._estimate")),
    # what uses those helpers does not reach into shard for them
    (("shardfn.optim", "shardfn._functional", "shardfn._remat", "shardfn._remat_state", "shardfn._remat_modules",
      "shardfn._pipeline", "shardfn._compile", "shardfn._collectives", "shardfn._shard_map", "shardfn.nn"),
     ("shardfn._fsdp",)),
    # the collectives sit under the transforms built on them
    (("shardfn._collectives",), ("shardfn._shard_map", "shardfn._remat", "shardfn._pipeline")),
    # shard does not import what is built on it
    (("shardfn._fsdp",),
     ("shardfn.optim", "shardfn._functional", "shardfn._pipeline", "shardfn._hf", "shardfn._estimate",
      "shardfn._checkpoint", "shardfn.checkpoint")),
]


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def shardfn_imports(path: pathlib.Path) -> set[str]:
    """The shardfn modules (or names in them) that the file at `path` imports, relative
    imports resolved; `from . import x` yields `package.x`."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {m for m in found if m == "shardfn" or m.startswith("shardfn.")}


def import_graph() -> dict[str, set[str]]:
    return {module_name(p): shardfn_imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_import_parser_sees_relative_lazy_and_package_imports():
    graph = import_graph()
    assert "shardfn._autodiff" in graph["shardfn._fsdp.step"]  # `from .._autodiff import ...`
    assert "shardfn._autodiff" in graph["shardfn.optim.train"]
    assert "shardfn._fsdp" in graph["shardfn._estimate"]  # a lazy `from ._fsdp import shard` in a function
    assert "shardfn._binding" in graph["shardfn.nn._layout"]  # `from .. import _binding, ...`
    assert "shardfn._params_view" in graph["shardfn._fsdp.view"]
    assert graph["shardfn._errors"] == set()


def test_layers_import_only_downwards():
    graph = import_graph()
    broken = []
    for modules, forbidden in LAYERS:
        for module in modules:
            covered = [m for m in graph if within(m, module)]
            assert covered, f"LAYERS names {module!r}, which is not a module of shardfn"
            broken += [f"{m} imports {i}" for m in covered for i in sorted(graph[m])
                       if any(within(i, f) for f in forbidden)]
    assert broken == [], "imports against the layering (DESIGN.md's layout):\n" + "\n".join(broken)


# -- the named internal API of a shard step ([Note: the composition table]'s neighbour:
# shardfn/_fsdp/api.py) --------------------------------------------------------------------


def shard_private_names() -> set[str]:
    """`Shard`'s private methods and the private attributes its __init__ sets."""
    from shardfn._fsdp.step import Shard

    names = {n for n in vars(Shard) if n.startswith("_") and not n.startswith("__")}
    init = ast.parse(textwrap.dedent(inspect.getsource(Shard.__init__)))
    names |= {node.attr for node in ast.walk(init)
              if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
              and node.attr.startswith("_") and not node.attr.startswith("__")}
    return names


def _own(node: ast.expr) -> bool:
    """`self` / `cls`: an object's own attributes are its business."""
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _a_step(node: ast.expr) -> bool:
    """`step`, `self.step`, `shard_step`: an expression that names a step."""
    return ast.unparse(node).split(".")[-1].endswith("step")


def step_misuses(source: str, filename: str, private: set[str]) -> list[str]:
    """Where `source` reads a private name of `Shard` on another object (`step._plan_for`),
    or sets a private attribute on a step (`step._checked = True`, `setattr(step, ...)`)."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr.startswith("_") and _a_step(target.value):
                found.append(f"{filename}:{node.lineno}: sets {ast.unparse(target)}")
        if isinstance(node, ast.Attribute) and node.attr in private and not _own(node.value) \
                and isinstance(node.ctx, ast.Load):
            found.append(f"{filename}:{node.lineno}: reads {ast.unparse(node)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) > 1 and _a_step(node.args[0]):
            found.append(f"{filename}:{node.lineno}: setattr on {ast.unparse(node.args[0])}")
    return sorted(found, key=lambda line: int(line.split(":")[1]))


def test_no_module_outside_fsdp_reaches_into_a_shard_step():
    private = shard_private_names()
    assert {"_plan_for", "_state", "_lay_out", "_check_shards", "_plans", "_states"} <= private
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if within(module_name(path), "shardfn._fsdp"):
            continue
        broken += step_misuses(path.read_text(), str(path.relative_to(PACKAGE.parent)), private)
    assert broken == [], ("use shardfn/_fsdp/api.py, not a shard step's private names or new attributes:\n"
                          + "\n".join(broken))


def test_the_private_access_check_catches_a_planted_call():
    private = shard_private_names()
    planted = ("def f(step, shards):\n"
               "    plan = step._plan_for(shards)\n"
               "    self.step._funcgrad_checked = True\n"
               "    setattr(step, '_x', 1)\n"
               "    self._plans = {}\n"
               "    x._y = 1\n"
               "    return api.plan_of(step, shards)\n")
    found = step_misuses(planted, "planted.py", private)
    assert found == ["planted.py:2: reads step._plan_for", "planted.py:3: sets self.step._funcgrad_checked",
                     "planted.py:4: setattr on step"]
