"""Routed experts as a pruning axis (REAP): their saliency over calibration tokens
(`saliency`, `stats`), which to remove (`selection`) and the surgery that removes them
(`surgery`), for every mixture-of-experts family transformers has (`layers`)."""
