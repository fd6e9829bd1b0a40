"""Initial schema: runs, streams, steps, layer stats, evals, checkpoints, resumes, health, anomalies.

Revision ID: 0001
Revises:
Create Date: 2026-11-22 00:52:50.976802
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "anomalies",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("severity", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("first_step", sa.BigInteger(), nullable=True),
        sa.Column("last_step", sa.BigInteger(), nullable=True),
        sa.Column("opened_at", sa.Float(precision=53), nullable=False),
        sa.Column("updated_at", sa.Float(precision=53), nullable=False),
        sa.Column("resolved_at", sa.Float(precision=53), nullable=True),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("hint", sa.Text(), nullable=False),
        sa.Column("evidence", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("anomalies", schema=None) as batch_op:
        batch_op.create_index("ix_anomalies_run", ["run", "kind", "rank", "status"], unique=False)

    op.create_table(
        "checkpoints",
        sa.Column("run", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("time", sa.Float(precision=53), nullable=False),
        sa.Column("path", sa.Text(), nullable=True),
        sa.Column("duration", sa.Float(precision=53), nullable=True),
        sa.Column("bytes", sa.BigInteger(), nullable=True),
        sa.Column("fingerprint", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("run", "rank", "attempt", "step"),
    )
    op.create_table(
        "evals",
        sa.Column("run", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("time", sa.Float(precision=53), nullable=False),
        sa.Column("loss", sa.Float(precision=53), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=True),
        sa.Column("duration", sa.Float(precision=53), nullable=True),
        sa.PrimaryKeyConstraint("run", "rank", "attempt", "step"),
    )
    op.create_table(
        "health",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("time", sa.Float(precision=53), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("health", schema=None) as batch_op:
        batch_op.create_index("ix_health_run_time", ["run", "time"], unique=False)

    op.create_table(
        "layer_stats",
        sa.Column("run", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("time", sa.Float(precision=53), nullable=False),
        sa.Column("grad_norms", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("run", "rank", "attempt", "step"),
    )
    op.create_table(
        "resumes",
        sa.Column("run", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("time", sa.Float(precision=53), nullable=False),
        sa.Column("path", sa.Text(), nullable=True),
        sa.Column("duration", sa.Float(precision=53), nullable=True),
        sa.Column("fingerprint", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("run", "rank", "attempt", "step"),
    )
    op.create_table(
        "runs",
        sa.Column("run", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.Float(precision=53), nullable=False),
        sa.Column("updated_at", sa.Float(precision=53), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=True),
        sa.Column("planned_steps", sa.BigInteger(), nullable=True),
        sa.Column("vocab_size", sa.Integer(), nullable=True),
        sa.Column("config", sa.JSON(), nullable=True),
        sa.Column("schedule", sa.JSON(), nullable=True),
        sa.Column("meta", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("run"),
    )
    op.create_table(
        "steps",
        sa.Column("run", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("time", sa.Float(precision=53), nullable=False),
        sa.Column("loss", sa.Float(precision=53), nullable=True),
        sa.Column("grad_norm", sa.Float(precision=53), nullable=True),
        sa.Column("grad_norm_clipped", sa.Float(precision=53), nullable=True),
        sa.Column("clip_coef", sa.Float(precision=53), nullable=True),
        sa.Column("lr", sa.Float(precision=53), nullable=True),
        sa.Column("lrs", sa.JSON(), nullable=True),
        sa.Column("loss_scale", sa.Float(precision=53), nullable=True),
        sa.Column("skipped", sa.Boolean(), nullable=True),
        sa.Column("tokens", sa.BigInteger(), nullable=True),
        sa.Column("samples", sa.BigInteger(), nullable=True),
        sa.Column("micro_batches", sa.Integer(), nullable=True),
        sa.Column("scheduler_steps", sa.Integer(), nullable=True),
        sa.Column("step_time", sa.Float(precision=53), nullable=True),
        sa.Column("phase_data", sa.Float(precision=53), nullable=True),
        sa.Column("phase_forward", sa.Float(precision=53), nullable=True),
        sa.Column("phase_backward", sa.Float(precision=53), nullable=True),
        sa.Column("phase_comm", sa.Float(precision=53), nullable=True),
        sa.Column("phase_optimizer", sa.Float(precision=53), nullable=True),
        sa.Column("phase_checkpoint", sa.Float(precision=53), nullable=True),
        sa.Column("phase_eval", sa.Float(precision=53), nullable=True),
        sa.Column("phase_other", sa.Float(precision=53), nullable=True),
        sa.Column("mem_allocated_bytes", sa.BigInteger(), nullable=True),
        sa.Column("mem_peak_bytes", sa.BigInteger(), nullable=True),
        sa.Column("batch_fingerprint", sa.String(length=64), nullable=True),
        sa.Column("update_ratio", sa.Float(precision=53), nullable=True),
        sa.PrimaryKeyConstraint("run", "rank", "attempt", "step"),
    )
    op.create_table(
        "streams",
        sa.Column("stream", sa.String(length=64), nullable=False),
        sa.Column("run", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("started_at", sa.Float(precision=53), nullable=False),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.Column("last_time", sa.Float(precision=53), nullable=False),
        sa.Column("events", sa.BigInteger(), nullable=False),
        sa.Column("missing", sa.BigInteger(), nullable=False),
        sa.Column("start", sa.JSON(), nullable=True),
        sa.Column("end_status", sa.String(length=16), nullable=True),
        sa.Column("end_step", sa.BigInteger(), nullable=True),
        sa.Column("end_error", sa.Text(), nullable=True),
        sa.Column("dropped_events", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("stream"),
    )
    with op.batch_alter_table("streams", schema=None) as batch_op:
        batch_op.create_index("ix_streams_run_rank", ["run", "rank"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("streams", schema=None) as batch_op:
        batch_op.drop_index("ix_streams_run_rank")

    op.drop_table("streams")
    op.drop_table("steps")
    op.drop_table("runs")
    op.drop_table("resumes")
    op.drop_table("layer_stats")
    with op.batch_alter_table("health", schema=None) as batch_op:
        batch_op.drop_index("ix_health_run_time")

    op.drop_table("health")
    op.drop_table("evals")
    op.drop_table("checkpoints")
    with op.batch_alter_table("anomalies", schema=None) as batch_op:
        batch_op.drop_index("ix_anomalies_run")

    op.drop_table("anomalies")
