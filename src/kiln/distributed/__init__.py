"""Running one engine across several processes: ranks, collectives, shared-memory all-reduce."""
