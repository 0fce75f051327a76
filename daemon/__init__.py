"""tally's core: ledger, slot pool, routing, planning and runs. Knows nothing of HTTP, MCP or argv."""
