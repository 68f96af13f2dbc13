"""Every command, one module each: its options as a dataclass (options, text_options),
checked once before anything loads; the command loads, calls a pure experiment, renders
and writes. Heavy imports (torch, TransformerLens) happen inside the commands, so
`blockscope --help` is instant. The command line (`blockscope.cli`) runs them.
"""

from blockscope.api import (  # noqa: F401  (registers the commands: one module each)
    ablate,
    attention,
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
    reproduce,
    resid_norm,
    shapes,
    toy_model,
    trace,
)
