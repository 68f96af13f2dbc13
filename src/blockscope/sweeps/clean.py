"""The clean pass: one hooked forward per window, keeping what every variant starts from.

It keeps each block's input (`hook_resid_pre`; and, where a user's hook sits there, the value
before it), the hook points the layout needs (`kept_names`), the arguments the model hands
each block (any K/V cache dropped), the NLL of every scored token, and the model's own NLL
for the last scored positions (from HF's logits) for the engine's self-check.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blockscope.inputs.text import Window
from blockscope.interventions import applied
from blockscope.model import adapters
from blockscope.sweeps import unembed
from blockscope.sweeps.naive import nll_from_logits, nll_of, per_position


@dataclass
class Clean:
    """What the clean pass of one window keeps (batch of 1, on the model's device)."""

    window: Window
    chunk: torch.Tensor  # (1, T) token ids fed
    block_args: list[tuple[tuple, dict]]  # per block: the (args, kwargs) the model passed it,
    #   cache removed, for replaying the block
    pre: list[torch.Tensor]  # n_layers + 1 of (1, T, d_model); pre[n_layers] enters ln_final
    acts: dict[str, torch.Tensor]  # other kept hook points, by name: (1, T, ...)
    nll: torch.Tensor  # (n_scored,) clean next-token NLL
    ref_nll: torch.Tensor  # (k,) the last k of it from the model's own logits (self-check)
    raw: dict[int, torch.Tensor]  # block inputs before a user's hooks on hook_resid_pre,
    #   for the blocks that have such hooks: re-entering there must not apply them twice
    checked: dict = field(default_factory=dict)  # selfcheck's verdicts on this pass
    views: dict = field(default_factory=dict)  # passes derived from it (`engine.pruned`)
    logits: torch.Tensor | None = None  # (n_scored, d_vocab) the naive loop's reference
    #   pass keeps its logits: each variant's KL is taken against them

    def reference(self, model, softcap: float | None) -> unembed.Reference | None:
        """The clean distribution at the scored positions, for the engine's KL (computed
        once per pass)."""
        if "kl" not in self.views:
            self.views["kl"] = unembed.reference(model, self.pre[-1], self.window, softcap)
        return self.views["kl"]

    def entering(self, layer: int) -> torch.Tensor:
        """What block `layer` receives, to run it again with its own hooks."""
        return self.raw.get(layer, self.pre[layer])

    def act(self, name: str, layer: int) -> torch.Tensor:
        return self.acts[f"blocks.{layer}.{name}"]


def kept_names(lay, n_layers: int, z: bool) -> list[str]:
    """The hook points a clean pass keeps besides the block inputs, for this layout."""
    per = ["hook_resid_mid"] if lay.has_mid else ["hook_attn_out", "hook_mlp_out"]
    per += (["attn.hook_z"] + (["hook_attn_out"] if lay.has_mid else [])) if z else []
    return [f"blocks.{i}.{n}" for i in range(n_layers) for n in per]


def clean_pass(model, tokens: torch.Tensor, w: Window, names=(), *,
               reference: bool = False) -> Clean:
    """One hooked forward of window `w`, keeping each block's input and the `names` asked
    for (`kept_names`), and the arguments each block was called with (any K/V cache
    dropped, positional or keyword, so replays never append to it). `reference`: the NLL
    from HF's full logits, the naive loop's own computation (`naive.window_nll`), never
    from the kept final residual."""
    n = model.cfg.n_layers
    chunk = tokens[:, w.begin : w.end].to(model.cfg.device)
    pre, acts, args_of = [None] * (n + 1), {}, [None] * n
    kept = kl_ref = None

    def keep(i=None, name=None):
        def hook(act, hook=None):
            if name is None:
                pre[i] = act.detach()
            else:
                acts[name] = act.detach()

        return hook

    hooks = [(f"blocks.{i}.hook_resid_pre", keep(i)) for i in range(n)]
    hooks += [(name, keep(name=name)) for name in names]
    hooks.append(("ln_final.hook_in", keep(n)))

    def record(i):
        def pre_hook(module, args, kwargs):
            args_of[i] = adapters.replayable_call(args, kwargs)

        return pre_hook

    handles = [b.register_forward_pre_hook(record(i), with_kwargs=True)
               for i, b in enumerate(model.blocks)]
    raw, firsts = {}, []

    def keep_raw(i):
        def hook(act, hook=None):
            raw[i] = act.detach()

        return hook

    for i, b in enumerate(model.blocks):  # before the user's own hooks there
        if b.hook_in.has_hooks():
            firsts.append((b.hook_in, b.hook_in.add_hook(keep_raw(i), prepend=True)))
    try:
        with torch.inference_mode(), applied(model, hooks):
            if not reference and _last_logits_only(model):  # from the final residual
                keep = min(REF_POSITIONS, w.end - w.first_target) + 1
                logits = model(chunk, return_type="logits", logits_to_keep=keep)  # (1, k+1, V)
                kl_ref = unembed.reference(model, pre[n], w, _softcap(model))
                nll = (unembed.clean_nll(model, kl_ref, chunk, w, _softcap(model))
                       if kl_ref is not None else
                       unembed.final_nll(model, pre[n], chunk, w, _softcap(model))[0])
                ref = nll_of(logits[0, :-1], chunk[0, 1 - keep:])
            else:
                logits = model(chunk, return_type="logits")  # (1, T, d_vocab)
                nll = ref = nll_from_logits(logits[0], chunk, w)
                kept = logits[0, w.offset - 1 : -1] if reference else None
    finally:
        for h in handles:
            h.remove()
        for point, handle in firsts:
            handle.hook.remove()
            point.fwd_hooks.remove(handle)
        drop_patterns(model)
    return Clean(w, chunk, args_of, pre, acts, nll, ref, raw, logits=kept,
                 views={} if kl_ref is None else {"kl": kl_ref})


def drop_patterns(model) -> None:
    """Let go of the attention pattern TransformerLens's joint-QKV attention keeps from the
    last forward (`attn._pattern`, batch x heads x T x T per layer: 445 MB for GPT-2 small
    at 900 tokens). Nothing blockscope runs reads it; kept, it would sit in memory through
    the whole sweep and into the next document's."""
    for block in model.blocks:
        attn = getattr(block, "attn", None)
        if getattr(attn, "_pattern", None) is not None:
            attn._pattern = None


REF_POSITIONS = 16  # the clean pass's last scored positions also scored from HF's logits



def _softcap(model) -> float | None:
    from blockscope.model.arch import layout

    return layout(model).softcap


def _last_logits_only(model) -> bool:
    """Whether the clean pass may ask HF for the last position's logits only (the NLL then
    comes from the kept final residual, as in every variant): the HF model must take
    `logits_to_keep` and no hook may sit on the unembedding, which would see one position."""
    import inspect

    hf = getattr(model, "original_model", None)
    try:
        takes = "logits_to_keep" in inspect.signature(hf.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return False
    return takes and not (model.unembed.hook_in.has_hooks() or model.unembed.hook_out.has_hooks())


def cached_means(clean: Clean, names) -> dict[str, torch.Tensor]:
    """Each kept hook point's clean mean over positions (what `naive.clean_sums` hooks
    for, divided by the positions), from one window's cache; block inputs and outputs come
    from `pre`."""
    out = {}
    for name in names:
        layer, point = name.split(".", 2)[1:]
        layer = int(layer)
        if point == "hook_resid_pre":
            t = clean.pre[layer]
        elif point == "hook_resid_post":
            t = clean.pre[layer + 1]
        else:
            t = clean.acts[name]
        out[name] = per_position(t, name).mean(0).float()
    return out
