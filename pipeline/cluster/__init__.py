"""Ray plumbing: joining or starting Ray, point pools, a model as workers receive
it, test-only fault hooks."""
