"""Storage: the schema (SQLite or PostgreSQL through SQLAlchemy), its Alembic migrations, and read queries."""
