"""Index a tenant's events by outcome: "this tenant's verification failures, newest first"
is the forensic query of an isolation incident, and must not scan all the tenant's events.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_audit_tenant_outcome_time",
        "audit_events",
        ["tenant_id", "outcome", "created_at", "generation_id"],
    )


def downgrade() -> None:
    op.drop_index("ix_audit_tenant_outcome_time", table_name="audit_events")
