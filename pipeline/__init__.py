"""Fleet orchestration for lorp: Ray capture and grid, evaluation backends, MLflow, catalog.

Everything that schedules, stores, evaluates or records lives here; the method itself is
in `lorp/`.
"""
