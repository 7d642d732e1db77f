"""The sub-layer study: pruning inside the block (attention, MLP and mixed sub-layers)
against whole blocks, at equal predicted decode cost, on the packaged models.

Two scripts: `run.py` measures every (granularity, method, budget) point of the grid and
writes docs/results/sublayers.md; `pairs.py` spends one block's decode cost on an MLP and
an attention of two other blocks. Beside them: `data.py` (what both measure on), `costs.py`
(a variant's predicted decode cost), `losses.py` (the held-out losses loss-guided methods
select by), `points.py` (the grid's budgets matched to a block budget's cost) and
`report.py` (the equal-cost comparison and the page).
"""
