"""A module's private names (`_name`) are its own: no other module of the package or its scripts imports one. A
name another module needs is public, so a change to it is seen as a change of an interface."""

from __future__ import annotations

import ast

from conftest import ROOT


def private_imports(source: str, module: str) -> list[tuple[int, str]]:
    """(line, 'module._name') of every private name `source` (the module `module`) imports from another module of
    the package, at the top level or inside functions."""
    found = []
    package = module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = package[: len(package) - node.level + 1] if node.level else []
        origin = ".".join([*base, *(node.module or "").split(".")]).strip(".")
        if origin.split(".")[0] != "trainer" or origin == module:
            continue
        found += [(node.lineno, f"{origin}.{alias.name}") for alias in node.names
                  if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_private_imports_are_found():
    source = "from trainer.x import _TABLE, public\nfrom .y import _f\nfrom trainer.x import __version__\n"
    assert private_imports(source, "trainer.z") == [(1, "trainer.x._TABLE"), (2, "trainer.y._f")]


def test_no_module_imports_another_modules_private_name():
    offenders = []
    for path in sorted([*(ROOT / "trainer").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]):
        rel = path.relative_to(ROOT)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        offenders += [f"{rel}:{line}: {name}" for line, name in private_imports(path.read_text(), module)]
    assert not offenders, "make the name public where another module needs it:\n" + "\n".join(offenders)
