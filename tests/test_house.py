"""House rules a reader can rely on (issue 24, check 1):

- no module imports a sibling inside a function to dodge an import cycle: the top-level import graph of
  radixserve/ has no cycle, and every import of radixserve inside a function is a deliberate lazy one
  whose line says why (`# lazy: <reason>`: start-up cost of a heavy dependency, the CLI's subcommands);
- no .py file in radixserve/ is over 400 lines, no C++ source over 600.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "radixserve"
MAX_PY_LINES = 400
MAX_CPP_LINES = 600  # the kernels' largest file (paged_attention.cpp) is ~560


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return ["." * node.level + (node.module or "")]


def _own(names: list[str]) -> bool:
    return any(n.startswith(("radixserve", ".")) for n in names)


def function_level_imports(source: str) -> list[tuple[int, str]]:
    """(line, source line) of every import of radixserve (or a relative one) inside a function body,
    outside `if TYPE_CHECKING:` blocks."""
    lines = source.splitlines()
    out: list[tuple[int, str]] = []

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    walk_stmt(sub, in_function)
                continue
            walk_stmt(child, in_function)

    def walk_stmt(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if in_function and _own(_imported(node)):
                out.append((node.lineno, "\n".join(lines[node.lineno - 1:node.end_lineno])))
            return
        walk(node, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(ast.parse(source), False)
    return out


def _py_files() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_walker_finds_function_level_imports() -> None:
    """The rule's own detector: a function-level import is found, a TYPE_CHECKING or module-level one is not."""
    src = (
        "from typing import TYPE_CHECKING\n"
        "from radixserve.server_args import ServerArgs\n"
        "if TYPE_CHECKING:\n"
        "    from radixserve.managers.req import Req\n"
        "def f():\n"
        "    import os\n"
        "    from radixserve.model_loader import get_tokenizer\n"
        "    if TYPE_CHECKING:\n"
        "        from radixserve.managers.scheduler import Scheduler\n"
        "    from . import sibling  # lazy: a reason\n"
        "class C:\n"
        "    def m(self):\n"
        "        import radixserve.metrics\n"
    )
    assert [ln for ln, _ in function_level_imports(src)] == [7, 10, 13]


def test_function_level_imports_say_why() -> None:
    """An import of radixserve inside a function is either moved to the top or marked `# lazy: why`."""
    unmarked = []
    for path in _py_files():
        for line, text in function_level_imports(path.read_text()):
            if "# lazy:" not in text:
                unmarked.append(f"{path.relative_to(PKG.parent)}:{line}: {text.strip()}")
    assert not unmarked, "move these to the module top (or say `# lazy: why` on the line):\n" + "\n".join(unmarked)


def _top_level_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in _py_files()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.parse(path.read_text()).body:  # module level only; TYPE_CHECKING blocks are ast.If
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("radixserve"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    deps.add(sub if sub in modules else node.module)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root, deps in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(deps)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_top_level_import_cycle() -> None:
    """With no cycle among the module-level imports, no function-level import is needed to break one."""
    assert _cycles(_top_level_graph()) == []


@pytest.mark.parametrize(("pattern", "limit"), [("*.py", MAX_PY_LINES), ("*.cpp", MAX_CPP_LINES),
                                                 ("*.h", MAX_CPP_LINES)])
def test_file_sizes(pattern: str, limit: int) -> None:
    files = sorted(PKG.rglob(pattern))
    if pattern == "*.py":
        assert files, "radixserve/ has no Python files?"
    long = {str(p.relative_to(PKG.parent)): n for p in files if (n := len(p.read_text().splitlines())) > limit}
    assert not long, f"over {limit} lines (split by responsibility): {long}"
