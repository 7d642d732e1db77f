"""Planning, before any Ray task or record: each model resolved and checked, its grid points
and their keys, how each point's removal is chosen, each stage's memory decision, and the
`lorp plan` report."""
