"""The scheduler's batch decision."""
