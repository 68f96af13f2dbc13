"""Every command, one module each, run by the command line (`blockscope.cli`) and by the
Python face (`face`, re-exported as `blockscope.<command>`). A command's options are a
dataclass (options, text_options), checked once before anything loads; the command loads
(or takes the held model), calls pure experiments and returns a `result.Result` (its tables,
sidecar, pictures and what the command line shows): the command line shows and saves it,
Python returns it. Heavy imports happen inside the commands, so `--help` is instant.
"""

from blockscope.api import (  # noqa: F401  (registers the commands: one module each)
    ablate,
    attention,
    attribute,
    circuit,
    get_model,
    head_roles,
    knockout,
    layernorm,
    logit_lens,
    mlp_memory,
    norm_placement,
    params,
    patch,
    prune_blocks,
    prune_heads,
    rearrange,
    report,
    reproduce,
    resid_norm,
    shapes,
    toy_model,
    trace,
)
