"""Nobody assigns to an ``Event`` but the collector's own stamps (``trainmon.wire.Event``).

An event is shared by every reader (the store, the live state, each detector, the detection child). It
was a frozen dataclass; it is a plain slots class now because a frozen ``__init__`` cost a setter call per
field on the million events of a long import. This test keeps the immutability the class gave up: it walks
the package's source and fails on any write to an event's field.

What counts as an event, read from the source alone (no types are inferred):

- a name the code gives events: ``e``, ``ev``, ``evt``, ``event``, or one ending in ``_event``
  (``first_event``), and any name annotated ``Event`` in its function;
- an item of a sequence named ``events`` or ending in ``_events`` (``events[i]``, ``slot.events[0]``).

A conventional name is not an event in a function that binds it otherwise: from a call to another class
(``ev = EvalPoint(...)``, a capitalised name) or as an exception (``except ... as e``).

What counts as a write: an assignment (plain, augmented, annotated, unpacked), a ``del``, and
``setattr``/``delattr``/``object.__setattr__``/``object.__delattr__`` on an event (any attribute: an event
has no other).
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

from trainmon.wire import Event

PACKAGE = Path(__file__).resolve().parents[1] / "trainmon"
FIELDS = frozenset(f.name for f in dataclasses.fields(Event))
NAMES = frozenset({"e", "ev", "evt", "event"})
SETTERS = frozenset({"setattr", "delattr", "object.__setattr__", "object.__delattr__"})

# The collector's stamps on the events it has just validated, before any reader sees them: (module, function,
# field). Each must still be there: a stamp that goes leaves its entry behind otherwise.
STAMPS = {
    ("monitor/collector/ingest.py", "_commit", "clock_offset"),  # the stream's clock offset, on live events
    ("monitor/collector/ingest.py", "_add_streams", "run"),  # the run a stream is stored apart under
}

Write = tuple[str, int, str]  # the enclosing function ("" at module level), the line, the field


def _is_sequence_of_events(node: ast.expr) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name == "events" or name.endswith("_events")


def _other_bindings(own: list[ast.AST]) -> set[str]:
    """Names a function binds to something visibly not an event: another class's instance, an exception."""
    names: set[str] = set()
    for node in own:
        if isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            called = ast.unparse(node.value.func).rsplit(".", 1)[-1]
            if called[:1].isupper() and called != "Event":
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _annotated_events(own: list[ast.AST]) -> set[str]:
    """Names a function annotates ``Event``: its parameters and annotated assignments."""
    names: set[str] = set()
    for node in own:
        if isinstance(node, ast.arg) and node.annotation is not None:
            if ast.unparse(node.annotation).rsplit(".", 1)[-1] == "Event":
                names.add(node.arg)
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and ast.unparse(node.annotation).rsplit(".", 1)[-1] == "Event"
        ):
            names.add(node.target.id)
    return names


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    """What ``node`` writes to, unpacked."""
    if isinstance(node, ast.Assign):
        pending = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        pending = [node.target]
    elif isinstance(node, ast.Delete):
        pending = list(node.targets)
    elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
        pending = [node.target]
    elif isinstance(node, ast.withitem) and node.optional_vars is not None:
        pending = [node.optional_vars]
    else:
        return
    while pending:
        target = pending.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            pending.extend(target.elts)
        elif isinstance(target, ast.Starred):
            pending.append(target.value)
        else:
            yield target


def _scopes(tree: ast.Module) -> Iterator[tuple[str, list[ast.AST]]]:
    """Each function (and the module), with the nodes that are its own (not a nested function's)."""
    todo: list[tuple[str, ast.AST]] = [("", tree)]
    while todo:
        name, scope = todo.pop()
        own: list[ast.AST] = []
        pending = list(ast.iter_child_nodes(scope))
        while pending:
            node = pending.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                todo.append((node.name, node))
            elif isinstance(node, ast.Lambda):
                todo.append((name, node))
            else:
                own.append(node)
                pending.extend(ast.iter_child_nodes(node))
        yield name, own


def event_writes(source: str) -> list[Write]:
    """The writes to an event's fields in ``source``, by the rules of the module docstring."""
    writes: list[Write] = []
    for name, own in _scopes(ast.parse(source)):
        events = (NAMES - _other_bindings(own)) | _annotated_events(own)

        def is_event(node: ast.expr, events: set[str] | frozenset[str] = events) -> bool:
            if isinstance(node, ast.Name):
                return node.id in events or node.id.endswith("_event")
            return isinstance(node, ast.Subscript) and _is_sequence_of_events(node.value)

        for node in own:
            for target in _targets(node):
                if isinstance(target, ast.Attribute) and target.attr in FIELDS and is_event(target.value):
                    writes.append((name, target.lineno, target.attr))
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) in SETTERS
                and node.args
                and is_event(node.args[0])
            ):
                attr = node.args[1] if len(node.args) > 1 else None
                writes.append((name, node.lineno, str(attr.value) if isinstance(attr, ast.Constant) else "?"))
    return sorted(writes, key=lambda w: w[1])


def test_nothing_in_the_package_writes_to_an_event_but_the_collectors_stamps() -> None:
    found: dict[tuple[str, str, str], list[int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        for function, line, attr in event_writes(path.read_text()):
            found.setdefault((module, function, attr), []).append(line)
    unsanctioned = {key: lines for key, lines in found.items() if key not in STAMPS}
    assert not unsanctioned, f"writes to a shared Event (build a new one, or dataclasses.replace): {unsanctioned}"
    assert set(found) == STAMPS, f"stamps listed but gone (drop them from STAMPS): {STAMPS - set(found)}"


def test_a_planted_write_in_a_detector_is_found() -> None:
    source = (PACKAGE / "monitor/detectors/hang.py").read_text()
    observe = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "observe")
    lines = source.splitlines(keepends=True)
    first = observe.body[0]
    lines.insert(first.lineno - 1, " " * first.col_offset + "ev.clock_offset = 1.0\n")
    assert event_writes(source) == []
    assert event_writes("".join(lines)) == [("observe", first.lineno, "clock_offset")]


def test_every_form_of_write_is_found() -> None:
    source = """
def f(events, slot, point: Event, x):
    ev.run = "r"
    event.time += 1.0
    first_event.seq: int = 3
    a, (b, e.rank) = 1, (2, 3)
    del evt.fields
    events[0].kind = "step"
    slot.events[-1].host = "h"
    slot.fresh_events[i].stream = "s"
    point.clock_offset = 0.5
    for ev.time in x: pass
    setattr(ev, "kind", "eval")
    object.__setattr__(slot.events[0], "clock_offset", 0.1)
    delattr(event, "run")
    setattr(ev, name, 1)
"""
    assert [line for _, line, _ in event_writes(source)] == list(range(3, 17))
    assert {attr for _, _, attr in event_writes(source)} == FIELDS | {"?"}


def test_what_is_not_an_event_or_not_a_write_is_not_found() -> None:
    source = """
def megatron(step, run):
    ev = EvalPoint(step, 1.0, {})
    ev.time = run.rel
def g(st, self, row, point, rows):
    st.run = "r"
    self.seq = 1
    row.kind = "x"
    point.time = 2.0
    rows[0].rank = 3
    ev.other = 1
    x = ev.run
    d[ev.rank] = ev.time
    setattr(point, "time", 1.0)
def h():
    try:
        pass
    except ValueError as e:
        e.kind = "error"
"""
    assert event_writes(source) == []
