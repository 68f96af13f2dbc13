"""Causal tracing (Meng et al. 2022, ROME's `experiments/causal_trace.py`).

The corrupted run adds Gaussian noise to the subject tokens' embeddings (`hook_embed`):
`scale` times one standard normal draw per (sample, subject token, feature), drawn on the CPU
by `torch.Generator().manual_seed(seed)` as one `randn(samples, n_subject, d_model)` tensor,
so anyone can redraw it. Each variant then restores, from the clean run, one position's
hidden state after a block (`resid`: `hook_resid_post`), or its MLP or attention output in
a window of `window` blocks centred on the row's block (`mlp`, `attn`: ROME's
`trace_important_window`, layers max(0, l - w//2) .. min(n, l + ceil(w/2)) - 1). The metric is
P(target) at the last position averaged over the samples; the indirect effect is that minus
the corrupted run's. `sever` ("mlp" or "attn") adds a kind `resid-sever-<part>`: the hidden
state restored while that part's outputs at the same position in every later block stay
at their corrupted values (ROME's severed MLP/attention).
"""

from __future__ import annotations

import pandas as pd
import torch

from blockscope.errors import BadValue
from blockscope.interventions.interchange import AddNoise, Edit, Patch, Site
from blockscope.sweeps.interchange import Run, sweep
from blockscope.sweeps.metrics import TargetProb
from blockscope.sweeps.settings import RunSettings
from blockscope.sweeps.variant import Variant

KINDS = ("resid", "mlp", "attn")
POINT = {"resid": "hook_resid_post", "mlp": "hook_mlp_out", "attn": "hook_attn_out"}
NOISE_RULE = ("noise = scale x torch.randn(samples, n_subject_tokens, d_model) from "
              "torch.Generator().manual_seed(seed) on the CPU, float32, added to hook_embed at "
              "the subject's tokens; scale = factor x std, std as `noise_std` says")
# How the noise's standard deviation is taken (`--noise-std`), besides a number given.
STD_RULES = {
    "subjects": "ROME's collect_embedding_std: the standard deviation (float64, n-1) of "
                "every entry of hook_embed's output on each subject tokenized alone (no "
                "special tokens), all subjects' tokens together",
    "embeddings": "the standard deviation (float64, n-1) of every entry of the token "
                  "embedding matrix W_E",
}


def embedding_std(model) -> float:
    """The standard deviation of every entry of the token embeddings W_E."""
    return float(model.W_E.detach().double().std())


def subjects_std(model, subjects: list[str]) -> float:
    """ROME's noise level (`collect_embedding_std`): the standard deviation of every entry
    of the embeddings (hook_embed's output) of the subjects' tokens, each subject tokenized
    alone, all subjects together."""
    from blockscope.sweeps.naive import activations

    rows = []
    for subject in subjects:
        ids = model.tokenizer.encode(subject, add_special_tokens=False)
        if not ids:
            raise BadValue(f"`subject` {subject!r} is no token")
        rows.append(activations(model, torch.tensor([ids]), ["hook_embed"])["hook_embed"])
    data = torch.cat(rows).double()  # (all subjects' tokens, d_model)
    if data.numel() < 2:
        raise BadValue("one number cannot give a standard deviation: give `noise_std`")
    return float(data.std())


def noise_std(model, rule: str | float, subjects: list[str]) -> tuple[float, dict]:
    """The noise's standard deviation by `rule` ("subjects", "embeddings" or a number), and
    the sidecar's record of it."""
    if rule == "subjects":
        std = subjects_std(model, subjects)
    elif rule == "embeddings":
        std = embedding_std(model)
    else:
        std = float(rule)
    return std, {"rule": rule if isinstance(rule, str) else "given", "std": std,
                 "how": STD_RULES.get(rule, "the number given") if isinstance(rule, str)
                 else "the number given", **({"n_subjects": len(subjects)}
                                              if rule == "subjects" else {})}


def draw_noise(seed: int, samples: int, n_subject: int, d_model: int, scale: float
               ) -> torch.Tensor:
    """The noise (samples, n_subject, d_model), as NOISE_RULE says."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(samples, n_subject, d_model, generator=g, dtype=torch.float32) * scale


def subject_span(tokenizer, ids: list[int], subject: str, prompt: str | None = None
                 ) -> tuple[int, int]:
    """The token range [lo, hi) that covers the first occurrence of `subject` in the decoded
    prompt (ROME's `find_token_range`); a refusal quotes `prompt` (the text as given),
    else the decoded tokens."""
    pieces = [tokenizer.decode([t]) for t in ids]
    text = "".join(pieces)
    at = text.find(subject)
    if at < 0 or not subject.strip():
        raise BadValue(f"`subject` {subject!r} is not in the prompt "
                       f"{text if prompt is None else prompt!r}")
    ends, pos = [], 0
    for piece in pieces:
        pos += len(piece)
        ends.append(pos)
    lo = next(i for i, e in enumerate(ends) if e > at)
    hi = next(i for i, e in enumerate(ends) if e >= at + len(subject)) + 1
    return lo, hi


def window_layers(layer: int, n_layers: int, window: int) -> range:
    """ROME's window of `window` blocks around `layer`."""
    return range(max(0, layer - window // 2), min(n_layers, layer - (-window // 2)))


def variants(n_layers: int, n_tokens: int, kinds, window: int, sever: str | None
             ) -> list[Variant]:
    out = []
    for kind in (*kinds, *([f"resid-sever-{sever}"] if sever else [])):
        for t in range(n_tokens):
            for layer in range(n_layers):
                if kind in ("mlp", "attn"):
                    edits = tuple(Edit(Site(POINT[kind], j, (t,)), Patch(), "clean")
                                  for j in window_layers(layer, n_layers, window))
                else:
                    edits = (Edit(Site("hook_resid_post", layer, (t,)), Patch(), "clean"),)
                    if kind != "resid":  # the severed part held at its corrupted value
                        edits += tuple(Edit(Site(POINT[sever], j, (t,)), Patch(), "base")
                                       for j in range(layer + 1, n_layers))
                out.append(Variant({"kind": kind, "layer": layer, "position": t}, edits))
    return out


def check(kinds, samples: int, window: int, sever: str | None) -> None:
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise BadValue(f"`kind` must be among {', '.join(KINDS)} (got {', '.join(bad) or 'none'})")
    if samples < 1 or window < 1:
        raise BadValue("`samples` and `window` must be at least 1")
    if sever not in (None, "mlp", "attn"):
        raise BadValue(f"`sever` must be mlp or attn (got {sever!r})")


def trace(model, tokens: torch.Tensor, span: tuple[int, int], *, target: int,
          kinds=KINDS, samples: int = 10, window: int = 10, noise: float = 3.0,
          std: float | None = None, sever: str | None = None,
          settings: RunSettings = RunSettings()) -> pd.DataFrame:
    """One row per (kind, layer, position): `kind, layer, position, token, p_target,
    indirect_effect`. attrs: p_clean, p_corrupted, the noise's scale and seed, how it ran.
    The noise is drawn with `settings.seed` (`draw_noise`), its scale `noise` x `std`
    (`noise_std`; None: `embedding_std`)."""
    seed = settings.seed
    check(kinds, samples, window, sever)
    lo, hi = span
    n, T = model.cfg.n_layers, tokens.shape[-1]
    scale = noise * (embedding_std(model) if std is None else std)
    eps = draw_noise(seed, samples, hi - lo, model.cfg.d_model, scale)
    base = Run(tokens, (Edit(Site("hook_embed", None, tuple(range(lo, hi))), AddNoise(), eps),),
               samples=samples)
    vs = variants(n, T, kinds, window, sever)
    res = sweep(model, base, {"clean": Run(tokens)}, vs, TargetProb(target), settings)
    low, high = float(res.base.mean()), float(res.sources["clean"][0])
    words = [model.tokenizer.decode([t]) for t in tokens[0].tolist()]
    rows = [{**v.label, "token": words[v.label["position"]], "p_target": float(p.mean()),
             "indirect_effect": float(p.mean()) - low} for v, p in zip(vs, res.values,
                                                                       strict=True)]
    df = pd.DataFrame(rows)
    df.attrs.update(p_clean=high, p_corrupted=low, noise_scale=scale, noise_factor=noise,
                    seed=seed, subject=[lo, hi], how=res.how)
    return df
