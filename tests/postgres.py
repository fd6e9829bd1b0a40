"""A throwaway PostgreSQL cluster on loopback for the storage tests (initdb + pg_ctl).

PostgreSQL refuses to run as root, so under root the server runs as the ``postgres`` system
user that Debian's package creates.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

_BIN_DIRS = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)


def _tool(name: str) -> str | None:
    for d in _BIN_DIRS:
        if (d / name).exists():
            return str(d / name)
    return shutil.which(name)


def _as_server_user(cmd: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return cmd
    return ["runuser", "-u", "postgres", "--", *cmd]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def throwaway_cluster(fsync: bool = False) -> Iterator[str]:
    """A PostgreSQL cluster in a temporary directory on a free loopback port, removed afterwards;
    yields a base URL without a database name. ``fsync=False`` for tests (durability is not what
    they check); the load benchmark keeps it on. Raises ``RuntimeError`` when it cannot run here."""
    initdb, pg_ctl = _tool("initdb"), _tool("pg_ctl")
    if initdb is None or pg_ctl is None:
        raise RuntimeError("PostgreSQL server binaries not installed (Debian package postgresql)")
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        raise RuntimeError("running as root without runuser: cannot start PostgreSQL as another user")
    root = Path(tempfile.mkdtemp(prefix="trainmon-pg-"))
    data = root / "data"
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    port = _free_port()
    subprocess.run(
        _as_server_user([initdb, "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8"]),
        check=True,
        capture_output=True,
    )
    opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync={'on' if fsync else 'off'}"
    subprocess.run(
        _as_server_user([pg_ctl, "-D", str(data), "-o", opts, "-l", str(root / "log"), "-w", "start"]),
        check=True,
        capture_output=True,
    )
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}"
    finally:
        subprocess.run(_as_server_user([pg_ctl, "-D", str(data), "-m", "immediate", "stop"]), capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def create_database(server: str, prefix: str = "t_") -> str:
    """A fresh, empty database on the cluster at ``server``; its URL."""
    import psycopg

    name = prefix + uuid.uuid4().hex[:12]
    with psycopg.connect(server.replace("postgresql+psycopg", "postgresql") + "/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"{server}/{name}"


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """Start a cluster once per session; yields a base URL without a database name."""
    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(throwaway_cluster())
        except RuntimeError as exc:
            pytest.skip(str(exc))
        yield url


@pytest.fixture
def postgres_url(postgres_server: str) -> str:
    """A fresh, empty database on the session's cluster."""
    return create_database(postgres_server)
