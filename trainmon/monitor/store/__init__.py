"""Storage: the schema (SQLite or PostgreSQL through SQLAlchemy), its Alembic migrations, and every
statement the daemon runs. Reads are functions named for what they return (``queries``: runs, streams,
anomalies; ``step_reads``: the steps table; ``event_reads``: checkpoints, resumes, evals, health,
per-layer norms; ``replay``: stored rows as events); ``writes`` holds the collector's writes besides
bulk inserts. No module outside this package runs SQL (``tests/store/test_sql_in_store.py``)."""
