"""Only a state's owner writes it (docs/design.md §2): every module under services/, learner/ and schemas/ is
read with `ast`, and an assignment that writes an attribute of an object the code does not own fails here:

- `a.b = …`, `a.b += …`, `del a.b`, `setattr(a, …)` where `a` is not `self` (or `cls`): another object's
  state, written from outside it;
- `self.x.y = …` (and `self.x[k].y = …`): the state of an object `self` only holds;
- `a.b[k] = …` and `self.x.y[k] = …`: the same, into a container that object holds; and `a.b.update(…)`,
  `.append`, `.add`, `.pop`, … on it, which write it as surely as an assignment.

Other objects are written through their methods. Exempt, because nobody else can hold them yet: an object
created in the same function, i.e. a local name bound only by a call to a class (`x = Foo(); x.y = 1`, or
`cls(...)` in a classmethod) or
a copy (`copy`, `deepcopy`, dataclasses `replace`); and a function's metadata (`wrapper.__name__ = …`,
`__doc__`, `__wrapped__`: what functools.wraps sets when it decorates). Writes into the contents of a
container or tensor reached through a plain local name (`buf[k] = …`) are not attribute writes and are not
judged here.

`MACHINE` and `ALLOWED` below are the exceptions, each with its reason; `ALLOWED` holds the number of writes
each such module has, so a new one fails here as well as one that went away (then lower the count, or drop
the entry)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.test_machine_state import RULES

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[1]
SELF = {"self", "cls"}
# the methods that write a container (dict, list, set, deque, Counter)
MUTATORS = {"update", "append", "appendleft", "extend", "add", "discard", "remove", "pop", "popleft", "popitem",
            "clear", "insert", "setdefault"}
COPIES = {"copy", "deepcopy", "replace"}

# The round machine's state (MachineState, plain data: services/syncer/machine_state.py) is written by the
# machine's own code, as designed (docs/design.md §4.1): RoundMachine (rounds.py), its Output
# (machine_state.py) and the rule modules, plain functions over (s, cfg, out) that are handed the state as
# `s` and keep nothing of their own (tests/test_machine_state.py checks that shape).
MACHINE = {f"services/syncer/{m}.py" for m in ("rounds", "machine_state", *RULES)}

# module -> (writes it has, why they are allowed): another library's objects, set the way that library
# documents, or patched on purpose
ALLOWED: dict[str, tuple[int, str]] = {
    "services/syncer/checkpoint.py": (2, "ctypes: a foreign function's prototype is declared by setting its "
                                         "argtypes/restype"),
    "services/syncer/outer.py": (3, "torch._inductor.config: torch's knobs are module attributes; a threading.local "
                                   "holds each thread's own scratch buffer"),
    "services/cmd_syncer.py": (1, "logging.Filter: a filter adds its field to the LogRecord it is handed"),
    "services/cli.py": (1, "argparse: the parsed Namespace is the command's input, normalized before dispatch"),
    "learner/demo.py": (6, "demo-only hooks: the fault injector (tests and soak only) wraps its wire's push and "
                           "its ops' pack; the gloo rendezvous's MASTER_ADDR in os.environ; argparse's port"),
    "learner/hybrid.py": (16, "patches torch.distributed (c10d) and keeps the patch's module state"),
    "learner/hybrid_calls.py": (12, "patched collectives bind their call arguments and keep per-group choices "
                                    "in the patch's module state and thread-local depth"),
    "learner/plugins/yeto_swift_plugin.py": (8, "the ms-swift plugin patches ms-swift's trainer and callback "
                                                 "map and sets its args"),
}


def _chain(node: ast.AST) -> tuple[str, list[str], bool] | None:
    """(root name, attribute names from the root, whether the write is into a subscript) of a target such
    as `a.b.c`, `a.b[k]` or `a.b[k].c`; None when it is not rooted at a name."""
    into_item = False
    while isinstance(node, ast.Subscript):
        node, into_item = node.value, True
    attrs: list[str] = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            attrs.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return node.id, attrs[::-1], into_item


def _bound(target: ast.AST) -> set[str]:
    """The names a binding target binds (`a`, `a, (b, *c)`; not the `x` of an `x.y` it writes)."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, ast.Starred):
        return _bound(target.value)
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_bound(e) for e in target.elts))
    return set()


def _created_here(fn: ast.AST) -> set[str]:
    """The local names bound only by a call to a class or a copy in this function (its nested functions
    aside): objects nobody else can hold yet."""
    made: set[str] = set()
    other: set[str] = set()
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        other |= {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
    todo = list(ast.iter_child_nodes(fn))
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            other.add(getattr(n, "name", ""))
            continue
        todo.extend(ast.iter_child_nodes(n))
        if isinstance(n, ast.Assign):
            ctor = False
            if isinstance(n.value, ast.Call):
                f = n.value.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                ctor = name[:1].isupper() or name == "cls" or name in COPIES
            for t in n.targets:
                if isinstance(t, ast.Name):
                    (made if ctor else other).add(t.id)
                elif isinstance(t, (ast.Tuple, ast.List)):
                    other |= _bound(t)
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)) and isinstance(n.target, ast.Name):
            other.add(n.target.id)
        elif isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension)):
            other |= _bound(n.target)
        elif isinstance(n, ast.withitem) and n.optional_vars is not None:
            other |= _bound(n.optional_vars)
        elif isinstance(n, ast.NamedExpr):
            other.add(n.target.id)
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            other |= set(n.names)
    return made - other


def _not_owned(target: ast.AST, created: set[str]) -> bool:
    c = _chain(target)
    if c is None:
        return False
    root, attrs, into_item = c
    if not attrs:
        return False                        # a local name, or an item of a container it names
    if not into_item and attrs[-1].startswith("__") and attrs[-1].endswith("__"):
        return False                        # a function's metadata: decorating it (functools.wraps)
    if root in SELF:
        return len(attrs) >= 2              # self.x = … and self.x[k] = … are its own
    return root not in created


def offenders(source: str) -> list[tuple[int, str]]:
    """(line, the write) of every write into state the code does not own (see the module docstring)."""
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST, fn: ast.AST, created: set[str]) -> None:
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(ch, ch, _created_here(ch))
                continue
            targets: list[ast.AST] = []
            if isinstance(ch, (ast.Assign, ast.Delete)):
                targets = list(ch.targets)
            elif isinstance(ch, ast.AugAssign) or isinstance(ch, ast.AnnAssign) and ch.value is not None:
                targets = [ch.target]
            for t in targets:
                for x in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]):
                    x = x.value if isinstance(x, ast.Starred) else x
                    if _not_owned(x, created):
                        out.append((ch.lineno, ast.unparse(x)))
            if isinstance(ch, ast.Call):
                f = ch.func
                if isinstance(f, ast.Name) and f.id == "setattr" and ch.args:
                    obj = ch.args[0]
                    if not (isinstance(obj, ast.Name) and (obj.id in SELF or obj.id in created)):
                        out.append((ch.lineno, ast.unparse(ch)))
                elif isinstance(f, ast.Attribute) and f.attr in MUTATORS and isinstance(f.value, ast.Attribute):
                    if _not_owned(f.value, created):
                        out.append((ch.lineno, ast.unparse(ch)))
            visit(ch, fn, created)

    tree = ast.parse(source)
    visit(tree, tree, _created_here(tree))
    return out


def _modules() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for d in ("services", "learner", "schemas")
            for p in sorted((ROOT / d).rglob("*.py"))}


def test_only_owners_write_their_state():
    modules = _modules()
    assert "services/syncer/service.py" in modules and "learner/island.py" in modules   # the walk found the code
    wrong, counts = [], {}
    for path, source in modules.items():
        if path in MACHINE:
            continue
        found = offenders(source)
        if path in ALLOWED:
            counts[path] = len(found)
        else:
            wrong += [f"{path}:{line}: {what}" for line, what in found]
    assert not wrong, "writes into state the code does not own (call a method of its owner):\n" + "\n".join(wrong)
    changed = {p: (n, ALLOWED[p][0]) for p, n in counts.items() if n != ALLOWED[p][0]}
    assert not changed, f"allowed writes changed (module: found, allowed): {changed}: fix the new ones, or lower the count"


def test_the_exceptions_name_real_modules():
    modules = _modules()
    assert not (set(ALLOWED) | MACHINE) - set(modules)
    assert all(reason for _, reason in ALLOWED.values())


@pytest.mark.parametrize("source,writes", [
    ("def f(cut):\n    cut.reissue[1] = (4, 5)", ["cut.reissue[1]"]),
    ("def f(st):\n    st.final = True", ["st.final"]),
    ("def f(x):\n    setattr(x, 'a', 1)", ["setattr(x, 'a', 1)"]),
    ("class A:\n    def f(self):\n        self.cut.commit_rev = 0", ["self.cut.commit_rev"]),
    ("class A:\n    def f(self):\n        self.rx.spec = self.m.spec", ["self.rx.spec"]),
    ("class A:\n    def f(self):\n        self.cut.final_digests.update({})", ["self.cut.final_digests.update({})"]),
    ("class A:\n    def f(self, k):\n        self.frags[k].params = None", ["self.frags[k].params"]),
    ("def f(d):\n    d.count += 1", ["d.count"]),
    ("def f():\n    t = g()\n    t.x = 1", ["t.x"]),
    ("def f(y):\n    t = T()\n    t = y\n    t.x = 1", ["t.x"]),
    # what is not judged: the owner's own state, an object made here, a local container, a function's metadata
    ("class A:\n    def f(self):\n        self.x = 1\n        self.d[1] = 2\n        self.items.append(3)", []),
    ("def f():\n    t = T()\n    t.x = 1\n    u = dataclasses.replace(t, x=2)\n    u.y = 3", []),
    ("def f():\n    e = E()\n    e.kind, e.rule = 1, 2", []),
    ("def f(buf):\n    buf[0] = 1", []),
    ("def deco(fn):\n    def w():\n        pass\n    w.__wrapped__ = fn\n    return w", []),
])
def test_the_check_sees_what_it_says(source, writes):
    assert [w for _, w in offenders(source)] == writes
