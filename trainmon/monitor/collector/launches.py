"""Which run a new producer stream is stored under: one job per run, whatever run names the jobs pick.

A run name is the user's choice, and two jobs may pick the same one at once: a relaunch while the old
job still runs, two people naming their run "test". Merged, they would be two "attempts" that overlap
in time (which no restart can produce) and one series that neither job wrote, with findings (a loss
spike, a rollback advice, a throughput collapse) that neither job has alone, and an ``on_critical="stop"``
that stops one person's job for the other's losses. So a run's identity is the name *and* the job:
the launch id every rank sends in ``run_start`` (``trainmon.hooks.launch``), the same on every rank of
one job and across its restarts.

The rule, decided when a launch's first stream arrives (every later stream of that launch, another
rank or a restart, follows it to the same run):

* a new stream of (run, rank) is a restart (a new attempt of the same run) if the run's earlier launch
  is over: it ended (rank 0 sent ``run_end``) or it has gone silent (:class:`Pulse`). Silence is judged
  against the job's own rhythm, because the commonest way a run gets its next attempt is a process
  killed without a word (OOM, SIGKILL, a node lost) and relaunched at once, often with a new launch id
  (a new process, ``torchrun --standalone``'s fresh rendezvous id): a job that sent every half second
  and then nothing for a few of its intervals has stopped, while a live job is heard at least every
  heartbeat (5 s by default). So a launch is live if it was heard from within four of its own recent
  intervals between events, never less than :data:`MIN_SILENCE` (no relaunch reaches its
  ``run_start`` sooner: Python, torch and the model are loaded first) and never more than the
  collector's ``clash_window_seconds``; after a collector restart, with no rhythm in memory, the
  store's last update is held against that window;
* a stream of a different launch arriving while another launch of that name is live is a clash: the
  newcomer is stored under a run id of its own, derived from the name and its launch
  (:func:`derived_run`), so the API, ``runs``, detection, goodput and notifications see two runs, never
  one merged series; both get a ``run_clash`` finding (:func:`clash_finding`) naming the other.

Nothing new is persisted: the launch id is stored with each stream's ``run_start`` (``streams.start``)
and a derived run id is a function of the name and the launch, so after a collector restart a stream
of a known launch finds its run in the store again.

What this rule cannot tell: a job that is silent longer than its bound while alive (a hung job, a
network partition) is taken for dead, and a second job started then is its restart, merged with it as
before launch ids existed; a relaunch within :data:`MIN_SILENCE` of its crash would be taken for a
second job.

Producers without a launch id (hooks older than it, imported logs, a multi-rank job whose launcher
the hooks do not recognise) are stored under the name they send, as attempts in arrival order, as
before: when their stream arrives the collector cannot tell a second job from a restart (a process
killed and restarted within seconds looks the same), and events that interleave prove two writers
only once both are stored in one run. Upgrading the hooks, or distinct run names, keeps them apart.
"""

from __future__ import annotations

import hashlib

from sqlalchemy import Connection, Row

from trainmon.monitor.collector.detection import RUN_WIDE, Found
from trainmon.monitor.detectors import Finding
from trainmon.monitor.store.queries import launch_hosts, launch_run, name_runs
from trainmon.monitor.store.retention import receiving

__all__ = ["KIND", "MIN_SILENCE", "Launches", "Pulse", "clash_finding", "derived_run", "stored_apart"]

KIND = "run_clash"
"""The anomaly kind of a clash: a ``warning`` (it is not the training's fault, but until the jobs have
names of their own the data of both is ambiguous to whoever reads them by name)."""

_SEPARATOR = ".launch-"  # within the run id pattern, so the API and the CLI take a derived id as any other
_DIGEST = 10
_NAME_CHARS = 128 - len(_SEPARATOR) - _DIGEST  # a derived id stays within the 128 characters of a run id
_MAX_HOSTS = 8  # named in a finding; the rest counted

MIN_SILENCE = 2.0
"""Seconds of silence a launch is always allowed: no process relaunched after a crash sends its
``run_start`` sooner (interpreter, torch and model load), so a launch heard from this recently is alive."""
_RHYTHM = 4.0  # a launch silent for this many of its own recent intervals between events has stopped
_SMOOTH = 0.2  # weight of the newest interval in the running estimate of a launch's rhythm
_MARKS = frozenset({"run_start", "run_end"})  # the kinds that start or end a run


class Pulse:
    """When a run was last heard from, whether it ended, and its rhythm (a running mean of the intervals
    between the times it was heard: arrivals live, event times on import)."""

    __slots__ = ("ended", "interval", "last")

    def __init__(self) -> None:
        self.last: float | None = None
        self.interval: float | None = None
        self.ended = False

    def beats(self, times: list[float], kinds: list[str], rank: int) -> None:
        """Hear the events of one stream (of ``rank``), in order: each of ``kinds`` at its time in ``times`` (a
        live batch's events share its arrival: one time for all of them). Rank 0's ``run_end`` ends the run, a
        ``run_start`` starts it again; each time later than the last heard is a beat, whose interval from the
        last enters the rhythm. A segment of events per call, not one call per event (a million-event import
        made a million calls here): the marks are looked for at C speed, the rhythm kept in locals."""
        if not _MARKS.isdisjoint(kinds):
            for kind in reversed(kinds):  # the last mark that counts decides
                if kind == "run_start":
                    self.ended = False
                    break
                if kind == "run_end" and rank == 0:  # as the run's status: rank 0's end is the run's
                    self.ended = True
                    break
        beats = iter(times)
        last, interval, smooth = self.last, self.interval, _SMOOTH
        if last is None:
            last = next(beats)
        for t in beats:
            if t > last:  # the events of one live batch share its arrival: one beat
                interval = t - last if interval is None else interval + smooth * (t - last - interval)
                last = t
        self.last, self.interval = last, interval

    def live(self, now: float, window: float) -> bool:
        """Heard from recently enough, for its rhythm, that it is still running."""
        if self.ended or self.last is None:
            return False
        bound = window if self.interval is None else min(window, max(MIN_SILENCE, _RHYTHM * self.interval))
        return now - self.last <= bound


def derived_run(name: str, launch: str) -> str:
    """The run id of a job that clashed with another under ``name``: stable for its launch."""
    return f"{name[:_NAME_CHARS]}{_SEPARATOR}{hashlib.sha256(launch.encode()).hexdigest()[:_DIGEST]}"


def _prefix(name: str) -> str:
    return name[:_NAME_CHARS] + _SEPARATOR


def stored_apart(run: str, name: str) -> bool:
    """Whether ``run`` is one of the runs a job sending as ``name`` may be stored under."""
    return run.startswith(_prefix(name))


def _jobs(jobs: dict[str, tuple[str | None, list[str]]], runs: list[str]) -> str:
    return "; ".join(f"{r!r} (launch {jobs[r][0] or 'not sent'}, {_hosts(jobs[r][1])})" for r in runs)


def _hosts(hosts: list[str]) -> str:
    more = len(hosts) - _MAX_HOSTS
    return (
        ("host " if len(hosts) == 1 else "hosts ")
        + ", ".join(hosts[:_MAX_HOSTS])
        + (f" and {more} more" if more > 0 else "")
    )


def clash_finding(name: str, run: str, jobs: dict[str, tuple[str | None, list[str]]]) -> Finding:
    """The ``run_clash`` finding on ``run``: ``jobs`` maps every run live under ``name`` (``run`` included)
    to its (launch id, hosts)."""
    others = [r for r in jobs if r != run]
    launch, hosts = jobs[run]
    return Finding(
        KIND,
        "warning",
        None,
        f"{len(jobs)} jobs use the run name {name!r} at the same time; they are kept apart: this run holds "
        f"launch {launch or 'not sent'} ({_hosts(hosts)}), the other job(s): {_jobs(jobs, others)}",
        "Give each job a run name of its own (TrainMonitor(run=...), e.g. with the date or the scheduler's job "
        "id). A relaunch is a restart of the same run once the old job has ended or gone silent: stop the old "
        "job first. Processes that are one job need one launch id "
        "(TRAINMON_LAUNCH_ID, or start(launch_id=...)).",
        {
            "name": name,
            "launch_id": launch,
            "hosts": hosts,
            "others": [{"run": r, "launch_id": jobs[r][0], "hosts": jobs[r][1]} for r in others],
        },
    )


class Launches:
    """(name, launch) -> run, decided group by group: a group's decisions (and its clash findings) are
    kept only if it commits (:meth:`commit`, :meth:`rollback`; :meth:`mark` and :meth:`undo` for one
    batch of it that is refused)."""

    def __init__(self, window: float) -> None:
        self.window = window
        self.pulses: dict[str, Pulse] = {}  # run -> its pulse, kept by the ingest path as it reads events
        self._runs: dict[tuple[str, str], str] = {}
        self._pending: dict[tuple[str, str], str] = {}
        self._hosts: dict[str, list[str]] = {}  # of the launches placed here, for the findings
        self._found: list[Found] = []

    def run_of(self, conn: Connection, name: str, launch: str | None, host: str, now: float) -> str:
        """The run a new stream of ``name`` and ``launch`` (from ``host``, arriving at ``now``) is stored
        under."""
        if launch is None:
            return name
        key = (name, launch)
        run = self._pending.get(key) or self._runs.get(key)
        if run is None:
            run = launch_run(conn, [name, derived_run(name, launch)], launch) or self._place(
                conn, name, launch, host, now
            )
            self._pending[key] = run
        hosts = self._hosts.setdefault(run, [])
        if host not in hosts:
            hosts.append(host)
        return run

    def _place(self, conn: Connection, name: str, launch: str, host: str, now: float) -> str:
        """A launch new to ``name``: the run itself if no other launch of it is live, else a run of its own."""
        stored = {r.run: r for r in name_runs(conn, name, _prefix(name))}
        placed = {r for (n, _), r in self._pending.items() if n == name} - set(stored)  # by this group
        live = sorted(r for r in set(stored) | placed if self._live(r, stored.get(r), now))
        run = derived_run(name, launch) if name in live else name
        if live:
            jobs = {run: (launch, [host]), **{r: self._job(conn, r) for r in live}}
            self._found += [(r, RUN_WIDE, clash_finding(name, r, jobs)) for r in jobs]
        return run

    def _live(self, run: str, stored: Row | None, now: float) -> bool:
        pulse = self.pulses.get(run)
        if pulse is not None:
            return pulse.live(now, self.window)
        # Not heard from since this collector started: the store's last word, against the window.
        return stored is not None and receiving(stored.status, stored.updated_at, now, self.window)

    def _job(self, conn: Connection, run: str) -> tuple[str | None, list[str]]:
        launch, hosts = launch_hosts(conn, run)
        if launch is None:  # not stored yet: placed earlier in this group
            launch = next((lid for (_, lid), r in self._pending.items() if r == run), None)
        return launch, sorted({*hosts, *self._hosts.get(run, [])})

    def mark(self) -> tuple[int, int]:
        return len(self._pending), len(self._found)

    def undo(self, mark: tuple[int, int]) -> None:
        """Forget what was decided since ``mark`` (a batch refused on its own)."""
        for key in list(self._pending)[mark[0] :]:
            del self._pending[key]
        del self._found[mark[1] :]

    def commit(self) -> list[Found]:
        """The group committed: keep its decisions; the clash findings it made, for the engine."""
        self._runs.update(self._pending)
        self._pending.clear()
        found, self._found = self._found, []
        return found

    def rollback(self) -> None:
        self._pending.clear()
        self._found.clear()

    def forget(self, runs: set[str]) -> None:
        """Drop evicted or deleted runs; a stream of theirs that comes later finds its run in the store."""
        self._runs = {k: r for k, r in self._runs.items() if r not in runs}
        for run in runs:
            self._hosts.pop(run, None)
            self.pulses.pop(run, None)
