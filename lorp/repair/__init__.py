"""Training-free linear repair of a pruned model, folded into weights it already has.

- `stats`: the mergeable sufficient statistics (`RepairStats`), and `capture`: their capture;
- `maps`: what a fitted map is and the closed-form `full` fit; `normed`: the fit that passes
  an RMSNorm; `fit`: every run's fit, validated on held-out windows; `followers`: maps on the
  blocks kept right after a cut;
- `fold`: the maps folded into weights (in memory or on files) or applied by hooks;
- `distill`: the maps tuned end to end towards the dense model's next-token distribution;
- `prune_and_repair`: the whole thing in one call.
"""
