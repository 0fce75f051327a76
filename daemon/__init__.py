"""tally's core: ledger, slot pool, routing, planning, runs. Knows nothing of HTTP or argv."""
