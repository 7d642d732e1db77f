"""The job on the driver: `run_job`, the fleet scheduler, each model's stages up to its
grid points, the tasks it submits, the recorder (the one writer of every record), and
`lorp gc`."""
