"""`blockscope reproduce`: the article's experiments with its settings, beside its figures.

- `figures`: the reference's face (the article's figures, the measures that need no weights
  and those that do, `compare`);
- `sections`: the pre- vs post-norm and head-role sections, and the article's claims;
- `mlp`: the MLP section (Steps 2 and 3) and the causal claims (patch, trace, knockout);
- `run`: `reproduce`, every section measured on one model as one pure function.
"""
