"""What a job says as it runs: the event log, the timeline of spans, progress lines, and
`lorp status` read back from them."""
