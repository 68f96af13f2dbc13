"""Why a block can be lost: each removal's change in the correct next token's centred logit,
split exactly into the component's own write, what later blocks change, and the final norm.

With the final norm's scale frozen at the clean run's value, the centred logit of the
correct token (its logit minus the mean logit over the vocabulary: a shift softmax ignores,
so it is not the log-probability) is a linear readout r of the final residual, and the
residual is the sum of the embeddings' and each block's write. For a removed component at
layer k, with w_j block j's write (clean) and w'_j (variant):

- total = centred logit (variant) - centred logit (clean);
- direct = r(own write' - own write): -r(w_k) for a zero ablation (the article's "removing a
  block removes one correction");
- downstream_j = r(w'_j - w_j) for every later block j (and, when a half is removed, block
  k's other half: downstream_k);
- final_norm = the variant's logit with its own final-norm scale minus with the clean scale.

Each is averaged over the scored tokens; direct + sum(downstream) + final_norm = total, and
a remainder above float32 rounding is an error, not a footnote. The self-repair fraction
is (direct - total) / direct: the share of the direct effect the rest gives back (McGrath
et al. 2023, "The Hydra Effect"; Rushing & Nanda 2024). The reads behind the terms come from
`sweeps.streams`: the cached engine (each variant from the block it removes, self-checked)
or the naive loop (one hooked forward each).
"""

from __future__ import annotations

import functools

import numpy as np
import pandas as pd
import torch

from blockscope.errors import BlockscopeError
from blockscope.model.arch import layout
from blockscope.sweeps import streams
from blockscope.sweeps.how import How
from blockscope.sweeps.naive import model_windows
from blockscope.sweeps.settings import RunSettings

TOLERANCE = 1e-4  # of the centred logit's scale: float32 rounding of the writes
MEANING = {
    "total": "mean over the scored tokens of the correct next token's centred logit (its "
    "logit minus the mean logit over the vocabulary; not the log-probability), variant - "
    "clean",
    "direct": "the removed component's own write, changed (minus its clean write for a zero "
    "ablation), read through the final norm with the clean run's scale and the target's "
    "centred unembedding row",
    "downstream_<j>": "block j's write, variant - clean, read the same way (block k's other "
    "half for a removed half)", "downstream": "the sum of downstream_<j>",
    "final_norm": "the variant's logit with its own final-norm scale minus with the clean "
    "run's", "self_repair": "(direct - total) / direct"}


class Readout:
    """r(x): the centred unembedding row of each scored token, read through the final norm
    with the clean run's scale (its linear part: the bias cancels), one value per token;
    and `final`, the same readout with a final residual's own scale (the norm's bias left
    out, as in r), to which `offset` adds the norm's bias and the unembedding's to give the
    centred logit. Built from the clean run's final residual h (T, d_model)."""

    def __init__(self, model, h: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor):
        self.model, ln = model, model.ln_final
        W = model.unembed.original_component.weight.detach()  # (d_vocab, d_model)
        self.rows, self.rms = rows, bool(ln.uses_rms_norm)
        self.u = W[targets].double() - W.mean(0, dtype=torch.float64)  # (n, d_model): the
        #   centred target rows
        scale = self._scale(model, self._centre(h[rows].double()))  # (n, 1)
        weight = (ln.weight.detach().double()
                  + (1.0 if getattr(ln, "uses_weight_offset", False) else 0.0))
        self.direction = self.u * weight / scale  # (n, d_model)
        bias = getattr(ln.original_component, "bias", None)
        self.beta = None if bias is None or self.rms else bias.detach().double()
        b_U = getattr(model.unembed.original_component, "bias", None)  # (d_vocab,) or None
        self.offset = torch.zeros(len(rows), dtype=torch.float64, device=self.u.device)
        if self.beta is not None:
            self.offset += self.u @ self.beta
        if b_U is not None:
            b_U = b_U.detach().double()
            self.offset += b_U[targets] - b_U.mean()

    def _centre(self, x):
        return x if self.rms else x - x.mean(-1, keepdim=True)

    @staticmethod
    def _scale(model, centred):
        eps = getattr(model.ln_final.original_component, "eps",
                      getattr(model.ln_final.original_component, "variance_epsilon", 1e-5))
        return (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """r(x) (..., n) for stream points x (..., T, d_model)."""
        return (self._centre(x[..., self.rows, :].double()) * self.direction).sum(-1)

    def final(self, x: torch.Tensor) -> torch.Tensor:
        """u . (LN'(h') - beta) (n,) for a final residual x (T, d_model): its own scale."""
        normed = self.model.ln_final(x[None, self.rows])[0].double()  # (n, d_model)
        if self.beta is not None:
            normed = normed - self.beta
        return (normed * self.u).sum(-1)


def terms(clean: dict, got: dict, k: int, part: str, n: int) -> dict:
    """One removal's per-token terms (n_scored,) from the reads of the clean run and of the
    variant (`streams.reads`): total, direct, downstream (n_layers, n_scored; NaN before
    the removed layer), final_norm."""
    write = [(got["stream"][j + 1] - got["stream"][j])
             - (clean["stream"][j + 1] - clean["stream"][j]) for j in range(n)]
    direct = got["change"]  # the removed component's own write, changed
    down = torch.full((n, len(direct)), float("nan"), dtype=torch.float64)
    for j in range(k + 1, n):
        down[j] = write[j]
    if part != "block":
        down[k] = write[k] - direct  # the other half of block k reacting
    return {"total": got["logit"] - clean["logit"], "direct": direct, "downstream": down,
            "final_norm": got["final"] - got["stream"][n]}  # own scale - the clean scale


def decompose(model, docs, variants, *, part: str, settings: RunSettings = RunSettings(),
              cleans: list | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(one row per removed component: `component, layer, part, total, direct, downstream,
    final_norm, self_repair, downstream_<j>`; one row per scored token and component).
    `variants[d]`: document d's removals; `cleans`: the one document's clean passes per
    window, if at hand. attrs["engine"]: how the reads ran (any fallback).
    Raises where the split is not exact: a final-logit softcap, or a remainder."""
    lay = layout(model)
    if lay.softcap is not None:
        raise BlockscopeError(f"{lay.family} softcaps its final logits (tanh), which is not "
                              "linear: the logit does not split into the writes; refusing")
    n = model.cfg.n_layers
    per_token, hows = [], []
    for d, ids in enumerate(docs.ids):
        for wi, w in enumerate(model_windows(model, ids, settings.stride)):
            clean, got, how = streams.reads(
                model, ids, w, variants[d], functools.partial(Readout, model),
                engine_name=settings.engine, batch_size=settings.batch_size,
                clean=cleans[wi] if cleans is not None else None, progress=settings.progress)
            hows.append(how)
            position = np.arange(w.offset, w.end - w.begin) + w.begin
            target = ids[0, w.begin + w.offset : w.end].cpu().numpy()
            for v, g in zip(variants[d], got, strict=True):
                t = terms(clean, g, v.edits[0].site.layer, part, n)
                frame = pd.DataFrame({"layer": v.label["layer"], "document": d,
                                      "position": position, "target": target,
                                      "total": t["total"].cpu().numpy(),
                                      "direct": t["direct"].cpu().numpy(),
                                      "final_norm": t["final_norm"].cpu().numpy()})
                for j in range(n):
                    frame[f"downstream_{j}"] = t["downstream"][j].cpu().numpy()
                per_token.append(frame)
    tokens = pd.concat(per_token, ignore_index=True)
    cols = [f"downstream_{j}" for j in range(n)]
    tokens["downstream"] = tokens[cols].sum(axis=1, min_count=1).fillna(0.0)
    means = tokens.groupby("layer", sort=True)[["total", "direct", "downstream", "final_norm",
                                                 *cols]].mean().reset_index()
    scale = max(1.0, float(np.abs(tokens[["total", "direct"]].to_numpy()).max()))
    left = (means["total"] - means["direct"] - means["downstream"] - means["final_norm"]).abs()
    if float(left.max()) > TOLERANCE * scale:
        raise BlockscopeError(f"the split leaves {float(left.max()):.2e} of the logit change "
                              "unexplained: direct + downstream + final norm must equal the "
                              "total; refusing a wrong split")
    means.insert(0, "component", [f"block {k}" + ("" if part == "block" else f" {part}")
                                  for k in means["layer"]])
    means.insert(2, "part", part)
    means.insert(7, "self_repair", (means["direct"] - means["total"]) / means["direct"])
    means.attrs["n_scored"] = int(len(tokens) // max(1, len(means)))
    said = {key: "; ".join(sorted({h[key] for h in hows if key in h})) or None
            for key in ("why_naive", "fallback")}
    means.attrs["engine"] = How("+".join(sorted({h["engine"] for h in hows})),
                                **said).record()
    return means, tokens


def headline(df: pd.DataFrame, n_layers: int) -> str:
    """What the article's explanation predicts (the total is the component's own write) and
    what was measured, for the middle component whose total is the median of the middle
    half's (its own figures, which add up); built from the figures."""
    mid = df[(df["layer"] >= n_layers // 4) & (df["layer"] < n_layers - n_layers // 4)]
    mid = mid if len(mid) else df
    row = mid.iloc[int(np.argsort(mid["total"].to_numpy())[len(mid) // 2])]

    def effect(value: float, s: str = "") -> str:  # against the own write's sign
        verb = f"add{s}" if np.sign(value) == np.sign(row["direct"]) else f"give{s} back"
        return f"{verb} {value:+.2f}"

    k = int(row["layer"])
    what = f"block {k}" if row["part"] == "block" else f"block {k}'s {row['part']}"
    return (f"the article's reading predicts that a removal changes the logit by the "
            f"component's own write; removing {what} (the median of the middle half) changes "
            f"the correct token's centred logit by {row['total']:+.2f}, its own write accounts "
            f"for {row['direct']:+.2f}, later blocks {effect(row['downstream'])} and the final "
            f"norm's scale {effect(row['final_norm'], 's')} (self-repair {row['self_repair']:.0%})")
