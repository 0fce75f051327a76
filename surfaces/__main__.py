"""`python -m surfaces …` is the same as the `tally` command (IDE configs use this form)."""

from surfaces.cli import main

raise SystemExit(main())
