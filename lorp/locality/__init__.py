"""The paper's measurement and allocation (Sec. 3-4).

- `similarity`: the matrix S (`LayerSimilarity`) and the per-token normalisation of Eq. 3;
  `similarity_stats`: the mergeable sums behind it; `capture`: their capture with hooks;
- `rls`: the Representation Locality Score (Eq. 5-6) and the K policy (Sec. 5.1);
- `clustering`: spectral clustering of layers on A = (S + 1) / 2 (Eq. 7);
- `allocation`: the two-stage budget allocation over clusters (Eq. 8-11);
- `profile`: a model's RLS, K and clusters, computed once from S.
"""
