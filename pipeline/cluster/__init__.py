"""Ray plumbing: joining or starting Ray, what its nodes offer, a model as workers receive
it, test-only fault hooks."""
