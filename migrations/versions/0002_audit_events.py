"""The audit log: one row per request, whatever its outcome; no prompt or completion text.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from gateway.tenancy.store import UTCDateTime

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "audit_events",
        sa.Column(
            "seq",
            sa.BigInteger().with_variant(sa.Integer, "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("generation_id", sa.String(100), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("key_id", sa.String(40)),
        sa.Column("model", sa.String(200)),
        sa.Column("outcome", sa.String(32), nullable=False),
        sa.Column("status", sa.Integer, nullable=False),
        sa.Column("code", sa.String(100)),
        sa.Column("prefill_worker", sa.String(300)),
        sa.Column("decode_worker", sa.String(300)),
        sa.Column("prompt_tokens", sa.Integer),
        sa.Column("completion_tokens", sa.Integer),
        sa.Column("stream", sa.Boolean, nullable=False),
        sa.Column("latency_ms", sa.Float, nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("detail", sa.Text),
    )
    # Idempotent replay of spooled events rests on this.
    op.create_index("uq_audit_generation_id", "audit_events", ["generation_id"], unique=True)
    # A tenant's newest events: an index range scan read backwards, no sort.
    op.create_index(
        "ix_audit_tenant_time", "audit_events", ["tenant_id", "created_at", "generation_id"]
    )
    # The admin's newest events across tenants.
    op.create_index("ix_audit_time", "audit_events", ["created_at", "generation_id"])


def downgrade() -> None:
    op.drop_table("audit_events")
