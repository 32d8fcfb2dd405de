"""Stored responses (the Responses API's ``store``): a tenant's, kept for its retention period.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from gateway.tenancy.store import UTCDateTime

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stored_responses",
        sa.Column("id", sa.String(100), primary_key=True),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("expires_at", UTCDateTime, nullable=False),
        sa.Column("response", sa.Text, nullable=False),
        sa.Column("input_items", sa.Text, nullable=False),
        sa.Column("context", sa.Text, nullable=False),
    )
    # A tenant's responses; every read also names the id, which is the primary key.
    op.create_index("ix_stored_responses_tenant", "stored_responses", ["tenant_id", "created_at"])
    # The sweep's range scan of what has expired.
    op.create_index("ix_stored_responses_expiry", "stored_responses", ["expires_at"])


def downgrade() -> None:
    op.drop_table("stored_responses")
