"""Fine-tuning stream heads against a frozen backbone (see issue 3; not yet implemented)."""
