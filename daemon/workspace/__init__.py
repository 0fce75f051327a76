"""Workspaces: a user's project directory, seen by a run's tasks only through copies.

A run may name a workspace inside roots the operator allowed (`roots`). At submit tally copies
its visible files (not `hide`, within the caps) into the run's base dir and witnesses their
identity (`snapshot`). Each task attempt works on its own copy of that base (`view`), inside
the sandbox; its changes are a unified diff (`view.capture`), and the user's files change
only through `patch.apply`, which refuses escaping paths and stale files. A chat task answers
in an edit format (`edits`) within a prompt built by `context`; `suites` finds a workspace's
own tests. `record` holds the typed bodies of the entries all this witnesses.

Nothing here imports the runs engine: these are file operations, called from `daemon.runs`.
"""
