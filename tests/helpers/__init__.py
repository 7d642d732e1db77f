"""What the tests share, in one package (never imported from `conftest.py`): tiny models
and job specs, token windows and residual-like states, the brute-force oracles the
method's equations are checked against, a local Ray, local servers and processes."""
