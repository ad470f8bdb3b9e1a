"""Repository rules that keep one room per mechanism: production code
imports nothing of `tract.testing`, and no module imports another's
underscore names (a module's private layout, checks and steps stay its
own)."""

import ast
from pathlib import Path

import tract

ROOT = Path(tract.__file__).parent


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        name = ".".join(("tract",) + path.relative_to(ROOT).with_suffix("").parts)
        yield name.removesuffix(".__init__"), ast.parse(path.read_text(), str(path))


def _imports(tree):
    """(imported module, names) of every import in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []


def test_production_code_imports_nothing_of_tract_testing():
    found = [(name, module) for name, tree in _modules()
             if not name.startswith("tract.testing")
             for module, names in _imports(tree)
             if module.startswith("tract.testing")
             or (module == "tract" and "testing" in names)]
    assert found == []


def test_no_module_imports_another_modules_underscore_names():
    modules = {name for name, _ in _modules()}
    found = [(name, module, imported) for name, tree in _modules()
             for module, names in _imports(tree)
             if module.startswith("tract")
             for imported in names
             if imported.startswith("_") and not imported.startswith("__") and module != name
             and f"{module}.{imported}" not in modules  # a private module of the package
             and not module.startswith("tract._native")]  # the extensions' own Python API
    assert found == []


def test_the_rules_see_imports():
    """The checks above find what they look for (they are not vacuous)."""
    tree = ast.parse("from tract.testing import faults\nfrom tract.lock import _x\n")
    assert list(_imports(tree)) == [("tract.testing", ["faults"]), ("tract.lock", ["_x"])]
