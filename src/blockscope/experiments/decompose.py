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
et al. 2023, "The Hydra Effect"; Rushing & Nanda 2024). The variants run as the naive loop
(one hooked forward each).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from blockscope.errors import BlockscopeError
from blockscope.interventions import applied, hooks
from blockscope.model.arch import layout
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


def _passes(model, chunk: torch.Tensor, edits, part: str) -> dict:
    """One forward of the window `chunk` (1, T) with `edits`' hooks: each block's input and
    the final residual (n + 1 of (T, d_model)), the final norm's output, the removed half's
    writes, and the logits, float64."""
    n = model.cfg.n_layers
    names = [f"blocks.{j}.hook_resid_pre" for j in range(n)] + ["ln_final.hook_in",
                                                                "ln_final.hook_out"]
    if part != "block":
        names += [f"blocks.{j}.hook_{part}_out" for j in range(n)]
    kept: dict = {}

    def keep(name):
        def hook(act, hook=None):
            kept[name] = act[0].detach().double()

        return hook

    with torch.inference_mode(), applied(model, hooks(edits) + [(m, keep(m)) for m in names]):
        logits = model(chunk.to(model.cfg.device), return_type="logits")[0].double()
    stream = [kept[f"blocks.{j}.hook_resid_pre"] for j in range(n)] + [kept["ln_final.hook_in"]]
    return {"stream": stream, "normed": kept["ln_final.hook_out"], "logits": logits,
            "half": [kept.get(f"blocks.{j}.hook_{part}_out") for j in range(n)]}


class Readout:
    """r(x): the centred unembedding row of each scored token, read through the final norm
    with the clean run's scale (its linear part: the bias cancels), one value per token."""

    def __init__(self, model, clean: dict, rows: torch.Tensor, targets: torch.Tensor):
        ln = model.ln_final
        W = model.unembed.original_component.weight.detach().double()  # (d_vocab, d_model)
        self.rows, self.rms = rows, bool(ln.uses_rms_norm)
        self.u = W[targets] - W.mean(0)  # (n, d_model): centred target rows
        h = clean["stream"][-1][rows]  # (n, d_model)
        scale = self._scale(model, self._centre(h))  # (n, 1)
        weight = (ln.weight.detach().double()
                  + (1.0 if getattr(ln, "uses_weight_offset", False) else 0.0))
        self.direction = self.u * weight / scale  # (n, d_model)
        bias = getattr(ln.original_component, "bias", None)
        self.bias = (torch.zeros(len(rows), dtype=torch.float64) if bias is None or self.rms
                     else self.u @ bias.detach().double())  # (n,): u . beta

    def _centre(self, x):
        return x if self.rms else x - x.mean(-1, keepdim=True)

    @staticmethod
    def _scale(model, centred):
        eps = getattr(model.ln_final.original_component, "eps",
                      getattr(model.ln_final.original_component, "variance_epsilon", 1e-5))
        return (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """r(x) (n,) for a stream-shaped x (T, d_model)."""
        return (self._centre(x[self.rows]) * self.direction).sum(-1)

    def centred_logit(self, run: dict, targets: torch.Tensor) -> torch.Tensor:
        z = run["logits"][self.rows]  # (n, d_vocab)
        return z.gather(-1, targets[:, None])[:, 0] - z.mean(-1)


def window_terms(model, chunk, w, variants, part: str) -> list[dict]:
    """Each variant's per-token terms (n_scored,) in window `w`: total, direct,
    downstream (n_layers, n_scored; NaN before the removed layer), final_norm."""
    n = model.cfg.n_layers
    lo = w.offset
    rows = torch.arange(lo - 1, chunk.shape[-1] - 1)  # the positions predicting the scored
    targets = chunk[0, lo:].to(rows.device)
    clean = _passes(model, chunk, (), part)
    r = Readout(model, clean, rows, targets)
    base = r.centred_logit(clean, targets)
    out = []
    for v in variants:
        (e,) = v.edits
        k = e.layer
        run = _passes(model, chunk, v.edits, part)
        total = r.centred_logit(run, targets) - base
        write = [r(run["stream"][j + 1] - run["stream"][j]
                   - (clean["stream"][j + 1] - clean["stream"][j])) for j in range(n)]
        direct = write[k] if part == "block" else r(run["half"][k] - clean["half"][k])
        down = torch.full((n, len(rows)), float("nan"), dtype=torch.float64)
        for j in range(k + 1, n):
            down[j] = write[j]
        if part != "block":
            down[k] = write[k] - direct  # the other half of block k reacting
        own = (run["normed"][rows] * r.u).sum(-1)  # u . LN'(h') with the variant's own scale
        frozen = r(run["stream"][-1]) + r.bias  # u . LN_c(h'): the clean run's scale
        out.append({"total": total, "direct": direct, "downstream": down,
                    "final_norm": own - frozen, "position": rows + w.begin,
                    "target": targets})
    return out


def decompose(model, docs, variants, *, part: str, settings: RunSettings = RunSettings()
              ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(one row per removed component: `component, layer, part, total, direct, downstream,
    final_norm, self_repair, downstream_<j>`; one row per scored token and component).
    Raises where the split is not exact: a final-logit softcap, or a remainder."""
    lay = layout(model)
    if lay.softcap is not None:
        raise BlockscopeError(f"{lay.family} softcaps its final logits (tanh), which is not "
                              "linear: the logit does not split into the writes; refusing")
    n = model.cfg.n_layers
    per_token = []
    for d, ids in enumerate(docs.ids):
        for w in model_windows(model, ids, settings.stride):
            chunk = ids[:, w.begin : w.end]
            for v, t in zip(variants[d], window_terms(model, chunk, w, variants[d], part),
                            strict=True):
                frame = pd.DataFrame({"layer": v.label["layer"], "document": d,
                                      "position": t["position"].numpy(),
                                      "target": t["target"].cpu().numpy(),
                                      "total": t["total"].numpy(), "direct": t["direct"].numpy(),
                                      "final_norm": t["final_norm"].numpy()})
                for j in range(n):
                    frame[f"downstream_{j}"] = t["downstream"][j].numpy()
                per_token.append(frame)
            if settings.progress:
                settings.progress()
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
