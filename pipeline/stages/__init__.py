"""The stages of a model's chain: calibration shards, S, loss-guided selection,
repair sums, grid points, and the Ray workers that run them."""
