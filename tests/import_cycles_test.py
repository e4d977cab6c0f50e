"""No import cycles in paged_jax/, pallas_kernels/, experiments/ (static, from the AST).

Every `import` and `from ... import` counts, at module level or inside a function (a
function-level import only postpones a cycle to the first call). `from pkg import name`
is an edge to `pkg.name` when that is a module, else to `pkg` itself. Importing a
submodule does not count as importing its parent package's __init__ (Python's partial
package initialisation makes that direction safe).
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("paged_jax", "pallas_kernels", "experiments")


def module_files(root, packages=PACKAGES):
  """{dotted module name: path} of every .py file under `packages` (package = __init__)."""
  out = {}
  for pkg in packages:
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, pkg)):
      dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__")))
      for fn in filenames:
        if fn.endswith(".py"):
          rel = os.path.relpath(os.path.join(dirpath, fn), root)[:-3].split(os.sep)
          name = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
          out[name] = os.path.join(dirpath, fn)
  return out


def import_graph(root, packages=PACKAGES):
  """{module: {imported module within `packages`}} from every import statement."""
  files = module_files(root, packages)
  graph = {}
  for name, path in files.items():
    is_pkg = path.endswith("__init__.py")
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
    deps = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        deps.update(a.name for a in node.names)
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:   # relative: strip `level` trailing parts (one fewer for a package)
          parts = name.split(".")[:len(name.split(".")) - node.level + is_pkg]
          base = ".".join(parts + ([base] if base else []))
        for a in node.names:
          sub = f"{base}.{a.name}"
          deps.add(sub if sub in files else base)
    graph[name] = {d for d in deps if d in files and d != name}
  return graph


def cycles(graph):
  """Strongly connected components with more than one module (Tarjan), each sorted."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(tuple(sorted(comp)))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return sorted(out)


def test_no_import_cycles():
  found = cycles(import_graph(ROOT))
  assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_detects_cycles_through_functions_and_relative_imports(tmp_path):
  pkg = tmp_path / "paged_jax"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from paged_jax import b\n")
  (pkg / "b.py").write_text("def f():\n  from paged_jax.sub import c\n")
  (pkg / "sub" / "__init__.py").write_text("")
  (pkg / "sub" / "c.py").write_text("from .. import a\nimport paged_jax.sub\n")
  (pkg / "d.py").write_text("import paged_jax.a\n")   # imports into the cycle, not part of it
  graph = import_graph(str(tmp_path), packages=("paged_jax",))
  assert graph["paged_jax.sub.c"] == {"paged_jax.a", "paged_jax.sub"}
  assert cycles(graph) == [("paged_jax.a", "paged_jax.b", "paged_jax.sub.c")]


def test_no_test_file_imports_another_test_file():
  """Each Bazel py_test holds its own file and the shared helpers (`tests/*.py` that are not
  `*_test.py`: tests/BUILD's test_support), so a test importing another test module passes
  under pytest and fails under Bazel: shared helpers belong in a *_support module."""
  tests_dir = os.path.join(ROOT, "tests")
  tests = {fn[:-3] for fn in os.listdir(tests_dir) if fn.endswith("_test.py")}
  bad = []
  for name in sorted(tests):
    with open(os.path.join(tests_dir, name + ".py"), encoding="utf-8") as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
      # `import x_test`, `from x_test import` and `from tests.x_test import` alike.
      bad += [f"{name} imports {n}" for n in names
              if n.removeprefix("tests.") in tests]
  assert not bad, bad
