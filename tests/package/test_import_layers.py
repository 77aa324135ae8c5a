"""The package's imports form layers: no cycle between modules (imports inside functions
counted), none between folders, and the lower floors import nothing from the upper ones. Read
from the source with ast, so the test sees every import whether or not it ever runs."""

import ast
import pathlib
import re

import gspo_kernels

PACKAGE = pathlib.Path(gspo_kernels.__file__).parent
# Floors, lowest first: a folder may import from its own floor and those below it.
FLOORS = [
    {"compat"},
    {"config", "backends"},
    {"distributed"},
    {"inputs"},
    {"sequence", "token_stats"},
    {"linear", "loss", "policy_loss"},
    {"integrations", "testing", "__init__"},
    {"bench"},
    {"cli", "__main__"},
]


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Every gspo_kernels module `path` imports, at module level or inside a function."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("gspo_kernels")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("gspo_kernels"):
                continue
            for alias in node.names:  # `from . import x` imports the module x
                found.add(target if f"{target}.{alias.name}" not in MODULES else f"{target}.{alias.name}")
    return found - {name}


FILES = sorted(PACKAGE.rglob("*.py"))
# The compiled extension is a module too (a leaf: it imports nothing of the package); setup.py names it.
_SETUP = PACKAGE.parent / "setup.py"
EXTENSIONS = set(re.findall(r'name="(gspo_kernels[\w.]*)"', _SETUP.read_text())) if _SETUP.exists() else set()
MODULES = {_module_name(p) for p in FILES} | EXTENSIONS
GRAPH = {_module_name(p): {m for m in _imports(p) if m in MODULES} for p in FILES} | {m: set() for m in EXTENSIONS}


def _room(module: str) -> str:
    """The folder (or top-level module) a module lives in, below gspo_kernels."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _floor(room: str) -> int:
    return next(i for i, rooms in enumerate(FLOORS) if room in rooms)


def test_the_graph_was_read():
    assert len(MODULES) > 40 and EXTENSIONS == {"gspo_kernels.backends._C"}
    assert "gspo_kernels.backends._C" in GRAPH["gspo_kernels.backends.native_backend"]
    assert "gspo_kernels.token_stats.on_logits" in GRAPH["gspo_kernels.loss"]
    assert "gspo_kernels.backends.contract" in GRAPH["gspo_kernels.backends.triton.row_ops"]
    assert "gspo_kernels.bench.table" in GRAPH["gspo_kernels.cli.check"]


def test_no_module_cycle():
    assert _cycle(GRAPH) is None, _cycle(GRAPH)


def test_no_folder_cycle_and_no_arrow_up():
    rooms = {}
    for module, deps in GRAPH.items():
        rooms.setdefault(_room(module), set()).update(_room(d) for d in deps if _room(d) != _room(module))
    assert _cycle(rooms) is None, _cycle(rooms)
    upward = [(a, b) for a, deps in rooms.items() for b in deps if _floor(b) > _floor(a)]
    assert not upward, upward


def test_distributed_knows_only_collectives_and_config():
    for module, deps in GRAPH.items():
        if _room(module) == "distributed":
            assert {_room(d) for d in deps} <= {"distributed", "config"}, (module, deps)


def test_few_modules_at_the_top():
    top = [p.name for p in PACKAGE.glob("*.py")]
    assert len(top) <= 8, top
