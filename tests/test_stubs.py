"""pydflash/_C.pyi lists exactly what pydflash._C defines (names and members)."""

import ast
import enum
from pathlib import Path

import pydflash
from pydflash import _C

STUB = Path(pydflash.__file__).with_name("_C.pyi")


def stub_names():
    tree = ast.parse(STUB.read_text())
    names, members = set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            names.add(node.target.id)
        if isinstance(node, ast.ClassDef):
            declared = (
                n.name
                if isinstance(n, ast.FunctionDef)
                else (n.target if isinstance(n, ast.AnnAssign) else n.targets[0]).id
                for n in node.body
                if isinstance(n, (ast.FunctionDef, ast.AnnAssign, ast.Assign))
            )
            # Dunders are left out, as on the module's side; the stub declares some
            # (__init__, __call__, __enter__) for type checkers.
            members[node.name] = {m for m in declared if not m.startswith("__")}
    return names, members


def module_names():
    names = {n for n in dir(_C) if not n.startswith("__") or n == "__version__"}
    members = {
        name: {m for m in vars(cls) if not (m.startswith("__") or private_machinery(cls, m))}
        for name in names
        if isinstance(cls := getattr(_C, name), type)
    }
    return names, members


def private_machinery(cls: type, member: str) -> bool:
    """pybind11's members, and the ones the standard library gives an enum or a named
    tuple (_member_map_, _make, _asdict): not part of what the stub declares."""
    if member.startswith("_pybind11"):
        return True
    return member.startswith("_") and issubclass(cls, (enum.Enum, tuple))


def test_stub_matches_the_module():
    stub, stub_members = stub_names()
    module, module_members = module_names()
    assert stub == module, f"only in stub: {stub - module}; only in module: {module - stub}"
    for cls, members in module_members.items():
        assert stub_members[cls] == members, f"{cls}: stub {stub_members[cls] ^ members}"


def test_package_ships_the_stub_and_py_typed():
    assert STUB.is_file()
    assert STUB.with_name("py.typed").is_file()
