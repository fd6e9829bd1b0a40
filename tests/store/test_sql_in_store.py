"""Every statement the daemon runs is written in ``trainmon/monitor/store/`` (issue 25, "one place for
SQL"): outside it no module executes SQL or builds a SQLAlchemy statement, so a schema change, a slow
query or a PostgreSQL difference is found and fixed in one package."""

from __future__ import annotations

import ast
from pathlib import Path

MONITOR = Path(__file__).resolve().parents[2] / "trainmon" / "monitor"
STORE = MONITOR / "store"
EXECUTE = {"execute", "executemany", "exec_driver_sql"}  # a connection's or a DB-API cursor's
BUILDERS = {"select", "insert", "update", "delete", "text"}  # SQLAlchemy's statement constructors


def sql_outside_store(source: str, where: str) -> list[str]:
    """``where:line what`` for each SQL execution or SQLAlchemy statement constructor in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in EXECUTE:
            found.append(f"{where}:{node.lineno} calls .{node.func.attr}(")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sqlalchemy":
            found += [
                f"{where}:{node.lineno} imports {a.name} from {node.module}" for a in node.names if a.name in BUILDERS
            ]
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in BUILDERS
            and isinstance(node.value, ast.Name)
            and node.value.id == "sqlalchemy"
        ):
            found.append(f"{where}:{node.lineno} uses sqlalchemy.{node.attr}")
    return found


def test_no_module_outside_store_runs_or_builds_sql() -> None:
    found = []
    for path in sorted(MONITOR.rglob("*.py")):
        if STORE not in path.parents:
            found += sql_outside_store(path.read_text(), str(path.relative_to(MONITOR)))
    assert not found, (
        "SQL outside trainmon/monitor/store/ (add a query there, named for what it returns):\n" + "\n".join(found)
    )


def test_the_scan_sees_each_way_of_writing_sql() -> None:
    source = (
        "import sqlalchemy\n"
        "import sqlalchemy.exc\n"
        "from sqlalchemy import Connection, select\n"
        "from sqlalchemy.dialects.sqlite import insert\n"
        "conn.execute(q)\n"
        "cur.executemany(q, rows)\n"
        "conn.exec_driver_sql('SELECT 1')\n"
        "sqlalchemy.text('SELECT 1')\n"
        "pool.submit(work)\n"
        "select.select([fd], [], [], 1.0)\n"
    )
    assert sql_outside_store(source, "m.py") == [
        "m.py:3 imports select from sqlalchemy",
        "m.py:4 imports insert from sqlalchemy.dialects.sqlite",
        "m.py:5 calls .execute(",
        "m.py:6 calls .executemany(",
        "m.py:7 calls .exec_driver_sql(",
        "m.py:8 uses sqlalchemy.text",
    ]
