"""Every choice a user makes from a fixed list, defined once as a `StrEnum`: the library
checks values against it and the command line offers its members as the option's choices.
A member is its string (`Part.attn == "attn"`), so either may be passed."""

from enum import StrEnum


class Part(StrEnum):
    """What of a block is removed: the whole block, or one half's write."""
    block = "block"
    attn = "attn"
    mlp = "mlp"


class Method(StrEnum):
    """What a removed component writes instead: nothing, its clean mean, another document's."""
    zero = "zero"
    mean = "mean"
    resample = "resample"


class EngineName(StrEnum):
    """How variants run: from where each departs from the base run, or one hooked forward
    each (the reference)."""
    cached = "cached"
    naive = "naive"


class Attribution(StrEnum):
    """How attribute estimates each patch from gradients: at the corrupted run (attribution
    patching), averaged along the path from it to the clean run (integrated gradients), or
    AtP with the QK fix and GradDrop (AtP*)."""
    atp = "atp"
    ig = "ig"
    atp_star = "atp-star"


class Granularity(StrEnum):
    """What attribute scores: patch's cells (nodes), or the edges between components."""
    node = "node"
    edge = "edge"


class Dtype(StrEnum):
    """The floating-point type the weights and activations run in."""
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


class HeadOrder(StrEnum):
    """The order prune-heads removes heads in."""
    gradient = "gradient"
    ablation = "ablation"
    random = "random"


class BlockOrder(StrEnum):
    """The order prune-blocks removes blocks in."""
    greedy = "greedy"
    ablation = "ablation"
    influence = "influence"
    angular = "angular"
    random = "random"


def one_of(choice: type[StrEnum], value, name: str):
    """`value` as a member of `choice`, or a BadValue naming the parameter and the choices."""
    from blockscope.errors import BadValue

    try:
        return choice(value)
    except ValueError:
        raise BadValue(f"`{name}` must be one of {', '.join(choice)}") from None
