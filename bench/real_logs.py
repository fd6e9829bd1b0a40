"""The post-mortem on every real log in ``../shared/real-logs/``, scored against the manifest's readings.

Each file is imported and analysed as ``trainmon postmortem FILE`` would, and its findings are compared
with the reading of that file encoded in ``tests/importers/test_real_logs.py`` (``EXPECT``: the anomalies the
reading justifies, the incidents it says must be flagged, at which steps). One table row a log, then
the headline line:

``logs=N as_expected=N false_alarms=K missed=M errors=E``

* ``false_alarms``: warning or critical findings that no part of the reading justifies (the known
  detector problems listed in ``EXPECT`` count: they are false alarms not yet fixed);
* ``missed``: incidents the reading says must be flagged and that were not;
* ``errors``: logs that could not be imported at all;
* ``as_expected``: logs with none of the three.

``--quick`` is the same run (it takes a few seconds): every log is part of the score.
``--dump FILE [LOG...]`` writes every finding of every log (all fields, evidence included) as JSON, to
compare two trees field by field (``--compare A B``) after a change that must not alter any finding;
extra paths (a long synthetic CSV) are dumped beside the real logs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.importers.test_real_logs import BY_FILE, EXPECT, LOGS, _matches, flagged_at  # noqa: E402  (the readings, once)
from trainmon.monitor.analysis.postmortem import import_file, summarize  # noqa: E402
from trainmon.monitor.store.storage import Storage  # noqa: E402
from trainmon.wire import json_safe  # noqa: E402


def _score(name: str) -> tuple[list[dict], list[str], str | None]:
    """(unjustified warning/critical findings, missed incidents, import error) of one log."""
    exp = EXPECT.get(name)
    storage = Storage("sqlite://")
    try:
        runs = import_file(LOGS / name, storage)
        anomalies = [a for run in runs for a in summarize(storage, run)["anomalies"]]
    except Exception as exc:  # one unreadable log is a score, not the end of the benchmark
        return [], [], f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    finally:
        storage.close()
    if exp is None:
        return [], [], "no reading encoded in tests/importers/test_real_logs.py"
    false = [
        a
        for a in anomalies
        if a["severity"] in ("warning", "critical")
        and not any(_matches(a, w.kind, w.lo, w.hi) and a["severity"] in w.severities for w in exp.allowed)
    ]
    missed = [
        f"{n.kind}@{n.step}" for n in exp.required if not any(flagged_at(a, n.kind, n.step, n.tol) for a in anomalies)
    ]
    return false, missed, None


def _findings(path: Path) -> list[dict] | str:
    """Every anomaly of every run the file holds, all fields; the error's text when it cannot be read."""
    storage = Storage("sqlite://")
    try:
        runs = import_file(path, storage)
        return [json_safe(a) for run in runs for a in summarize(storage, run)["anomalies"]]
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        storage.close()


def _dump(out: Path, extra: list[str]) -> None:
    paths = [LOGS / name for name in sorted(BY_FILE)] + [Path(p) for p in extra]
    out.write_text(json.dumps({p.name: _findings(p) for p in paths}, indent=1, sort_keys=True))
    print(f"{len(paths)} files: findings in {out}")


def _compare(a: Path, b: Path) -> int:
    """Logs whose findings differ between two dumps, with the first difference; 0 when none do."""
    left, right = json.loads(a.read_text()), json.loads(b.read_text())
    differ = 0
    for name in sorted(set(left) | set(right)):
        x, y = left.get(name), right.get(name)
        if x == y:
            continue
        differ += 1
        print(f"differs: {name}")
        if isinstance(x, list) and isinstance(y, list):
            for i, (u, v) in enumerate(zip(x, y, strict=False)):
                if u != v:
                    keys = sorted(k for k in set(u) | set(v) if u.get(k) != v.get(k))
                    print(f"  finding {i} ({u.get('kind')}): {keys}")
                    break
            else:
                print(f"  {len(x)} findings against {len(y)}")
        else:
            print(f"  {str(x)[:160]!r} against {str(y)[:160]!r}")
    print(f"files={len(set(left) | set(right))} differ={differ}")
    return 1 if differ else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the same run (it is quick already)")
    ap.add_argument("--dump", metavar="FILE", help="write every finding of every log to FILE (JSON) and stop")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two --dump files and stop")
    ap.add_argument("extra", nargs="*", help="with --dump: more log files to dump beside the real logs")
    args = ap.parse_args()
    if args.compare:
        raise SystemExit(_compare(Path(args.compare[0]), Path(args.compare[1])))
    if args.dump:
        _dump(Path(args.dump), args.extra)
        return
    if not BY_FILE:
        raise SystemExit(f"{LOGS}: no manifest.json, nothing to score")
    t0 = time.perf_counter()
    names = sorted(BY_FILE)
    as_expected = false_total = missed_total = errors = 0
    for name in names:
        false, missed, error = _score(name)
        ok = not false and not missed and error is None
        as_expected += ok
        false_total += len(false)
        missed_total += len(missed)
        errors += error is not None
        verdict = "ok" if ok else "ERROR" if error else "off"
        print(f"{verdict:5s} {name:45s} false_alarms={len(false)} missed={len(missed)}")
        if error:
            print(f"        {error}")
        for a in false:
            where = f"{a['kind']} {a['severity']} {a['first_step']}-{a['last_step']}"
            print(f"        false alarm: {where}: {a['message'][:110]}")
        for m in missed:
            print(f"        missed: {m}")
    print(f"\n{len(names)} logs in {time.perf_counter() - t0:.1f} s")
    print(
        f"logs={len(names)} as_expected={as_expected} false_alarms={false_total} missed={missed_total} errors={errors}"
    )


if __name__ == "__main__":
    main()
