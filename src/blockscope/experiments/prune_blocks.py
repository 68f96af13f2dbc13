"""How many blocks can go together: remove them cumulatively (each removed block's output :=
its input) and score every step, in the orders of the layer-pruning papers:

- "greedy" (SLEB, Song et al. 2024): at each step the block whose removal, given those
  already removed, raises the perplexity least (every remaining block tried);
- "ablation": ranked once by the single-block sweep (`ablate`), mildest first;
- "influence" (ShortGPT, Men et al. 2024): ranked once by Block Influence, lowest first;
- "angular" (Gromov et al. 2024): for each n, the n contiguous blocks whose input and
  output are closest in angular distance, removed together. The windows are not nested:
  this order is not cumulative;
- "random": a seeded permutation.

`block_curve` returns one DataFrame per order; `headline` reads the most blocks removed
within a tolerance off each curve (the last step before it first leaves the band).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pandas as pd
import torch

from blockscope.choices import BlockOrder
from blockscope.errors import BadValue, BlockscopeError
from blockscope.experiments.similarity import BlockSimilarity
from blockscope.inputs.corpus import as_docs
from blockscope.interventions import skip_block
from blockscope.sweeps import scoring, units
from blockscope.sweeps.settings import RunSettings
from blockscope.sweeps.variant import Variant

ORDERS = tuple(BlockOrder)  # every order, in the order the CLI lists them
ROW = ["n_scored", "nll", "perplexity", "delta", "ratio", "kl", "ci_low", "ci_high",
       "delta_ci_low", "delta_ci_high"]
COLUMNS = ["order", "step", "removed", "n_removed", "share_params", *ROW]
MEANINGS = {
    "removed": "the blocks removed at that step (counting from 0), in the order removed; "
    "each one's output := its input",
    "share_params": "parameters of the removed blocks over all the model's parameters "
    "(embeddings included, tied ones once)",
    "angular": "per n, the window l..l+n-1 minimising mean over tokens (all but each "
    "document's first) of arccos(cos(input of block l, output of block l+n-1))/pi",
    "influence": "Block Influence = 1 - mean cos(block input, block output), same tokens",
    "greedy": "every remaining block tried at each step; the lowest perplexity is removed "
    "(ties: the lower layer)",
}


def check_orders(orders) -> None:
    for o in orders:
        if o not in ORDERS:
            raise BadValue(f"`order` must be one of {', '.join(ORDERS)} (got {o})")


class WindowDistance:
    """Accumulates mean_t arccos(cos(x_l, x_{l+n}))/pi for every pair of block inputs
    (pre[l], pre[l+n]) over windows: `table[l, l+n]`, n >= 1 (Gromov et al.'s distance),
    per document (`add(index, clean)`), joined in corpus order (`_joined`)."""

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self.parts: dict[int, dict[str, torch.Tensor]] = {}  # document -> its sums
        self.sums = None  # the totals, once joined
        self.count = 0

    def add(self, index: int, clean) -> None:
        lo = clean.window.offset  # the positions this window scores for the first time
        x = torch.stack([p[0, lo:].double() for p in clean.pre])  # (L+1, n, d_model)
        x = torch.nn.functional.normalize(x, dim=-1)
        cos = torch.einsum("and,bnd->abn", x, x).clamp(-1, 1)  # (L+1, L+1, n)
        L = self.n_layers
        sums = self.parts.setdefault(index, {
            "sums": torch.zeros(L + 1, L + 1, dtype=torch.float64),
            "count": torch.zeros((), dtype=torch.float64)})
        sums["sums"] += (torch.arccos(cos) / math.pi).sum(-1).cpu()
        sums["count"] += x.shape[1]

    def best(self, n: int) -> tuple[int, float]:
        """(first block, distance) of the n-block window with the smallest distance."""
        L = self.sums.shape[0] - 1
        d = [float(self.sums[i, i + n]) / self.count for i in range(L - n + 1)]
        first = int(np.argmin(d))
        return first, d[first]


def block_params(model) -> tuple[list[int], int]:
    """Parameters of each block, and of the whole model (shared tensors once)."""
    from blockscope.experiments.params import block_counts

    per, total = block_counts(model.original_model.config)
    if len(per) != model.cfg.n_layers:
        raise BlockscopeError(f"counted parameters in {len(per)} blocks, but the model has "
                              f"{model.cfg.n_layers}")
    return per, total


def block_curve(
    model, tokens, *, orders=("greedy",), ablation: pd.DataFrame | None = None,
    max_removed: int | None = None, settings: RunSettings = RunSettings(),
) -> tuple[list[pd.DataFrame], dict]:
    """One curve per order (rows: step 0 = the baseline, then each step), and the cheap
    metrics the static orders were ranked by (`{"influence": [...], "angular": [...]}`).

    tokens: a passage `(1, pos)` or `corpus.Docs`. max_removed: stop after that many blocks
    (default all). ablation: the single-block sweep (`ablate.block_ablation`), if at hand.
    The random order is drawn with `settings.seed`."""
    check_orders(orders)
    L = model.cfg.n_layers
    top = L if max_removed is None else max_removed
    if not 1 <= top <= L:
        raise BadValue(f"`max_removed` must be between 1 and {L} (got {top})")
    docs = as_docs(tokens)
    prepared = scoring.prepare(model, docs, settings)
    progress, quiet = settings.progress, settings.quiet()  # this curve reports per step
    similarity, windows = BlockSimilarity(L), WindowDistance(L)

    def seen(index, clean):
        similarity.add(index, clean)
        windows.add(index, clean)

    kw = dict(settings=quiet, prepared=prepared)
    base = scoring.scores(model, docs, [], on_clean=seen, **kw)
    similarity, per, total = similarity.joined(docs.comm), *block_params(model)
    windows = _joined(windows, docs.comm)
    if progress:
        progress(total=len(orders) * top + 1)
        progress()
    skips = [skip_block(i) for i in range(L)]  # one per block
    ranked = {}
    if "ablation" in orders:
        if ablation is None:
            from blockscope.experiments.ablate import block_ablation

            ablation = block_ablation(model, docs, settings=replace(quiet, ci=None))
        rows = ablation.iloc[1:].sort_values("perplexity", kind="stable")
        ranked["ablation"] = [int(r) for r in rows["layer"]]
    influence = similarity.frame()["block_influence"].tolist()
    ranked["influence"] = sorted(range(L), key=lambda i: (influence[i], i))
    drawn = torch.Generator().manual_seed(settings.seed)
    ranked["random"] = torch.randperm(L, generator=drawn).tolist()
    angular = [windows.best(n) for n in range(1, L + 1)]
    curves = []
    for order in orders:
        if order == "greedy":
            steps, scores = _greedy(model, docs, base, skips, top, kw, progress)
        else:
            steps = ([list(range(f, f + n)) for n, (f, _) in enumerate(angular[:top], 1)]
                     if order == "angular" else
                     [ranked[order][:n] for n in range(1, top + 1)])
            scores = scoring.scores(model, docs, [Variant({}, tuple(skips[i] for i in s))
                                               for s in steps], **kw)
            scores = [(scores, i + 1) for i in range(len(steps))]
            if progress:
                for _ in steps:
                    progress()
        curves.append(_curve(order, base, steps, scores, per, total, settings.ci))
    metrics = {"influence": influence,
               "angular": [{"n": n, "first": f, "distance": d}
                           for n, (f, d) in enumerate(angular, 1)]}
    return curves, metrics


def _greedy(model, docs, base, skips, top: int, kw: dict, progress):
    """SLEB's order: at each step every remaining block tried with those removed so far;
    the lowest summed NLL goes (ties: the lower layer). (steps, [(scores, column)])."""
    removed: list[int] = []
    steps, scores = [], []
    for _ in range(top):
        left = [i for i in range(len(skips)) if i not in removed]
        tried = scoring.scores(model, docs, [Variant({}, tuple(skips[j] for j in removed + [i]))
                                          for i in left], **kw)
        totals = tried.of("nll")[:, 1:].sum(0)  # (len(left),)
        best = int(np.argmin(totals))  # the first minimum: the lowest layer on ties
        removed = removed + [left[best]]
        steps.append(removed)
        scores.append((tried, best + 1))
        if progress:
            progress()
    return steps, scores


def _curve(order, base, steps, scores, per, total, ci) -> pd.DataFrame:
    """Step 0 (the baseline), then each step's row, its interval paired with the baseline."""
    import dataclasses

    hows = [base.how]
    rows = [{"order": order, "step": 0, "removed": "", "n_removed": 0, "share_params": 0.0,
             **base.frame(ci).iloc[0][ROW].to_dict()}]
    for k, (blocks, (s, col)) in enumerate(zip(steps, scores, strict=True), 1):
        pair = dataclasses.replace(base, labels=base.labels + [s.labels[col]],
                                   sums=np.concatenate([base.sums, s.sums[:, col:col + 1]], 1))
        hows.append(s.how)
        rows.append({"order": order, "step": k, "removed": ",".join(map(str, blocks)),
                     "n_removed": len(blocks),
                     "share_params": sum(per[i] for i in blocks) / total,
                     **pair.frame(ci).iloc[1][ROW].to_dict()})
    df = pd.DataFrame(rows)[COLUMNS]
    df.attrs["engine"] = units.merged_how(hows)  # every replay used, every fallback
    return df


def _joined(w: WindowDistance, comm) -> WindowDistance:
    from blockscope.inputs.parallel import total

    parts = total(comm, sorted(w.parts.items()))
    out = WindowDistance(w.n_layers)
    out.sums, out.count = parts["sums"], float(parts["count"])
    return out


def prunable(curve: pd.DataFrame, tolerance: float) -> pd.Series:
    """The last row before the curve first leaves the band perplexity <= baseline*(1+tol)."""
    out = (curve["ratio"] > 1 + tolerance).to_numpy()
    first_out = int(out.argmax()) if out.any() else len(curve)
    return curve.iloc[max(first_out - 1, 0)]


def headline(curves: list[pd.DataFrame], tolerance: float, n_layers: int) -> dict:
    """Per order: the most blocks removed within the band, and the sentence that says so."""
    found = {}
    for c in curves:
        r = prunable(c, tolerance)
        order, base = c.loc[0, "order"], c.loc[0, "perplexity"]
        left = c.index[(c["ratio"] > 1 + tolerance).to_numpy()]
        exit = ("; the curve never leaves the band" if not len(left) else
                f"; removing {int(c.loc[left[0], 'n_removed'])} leaves it "
                f"(x{c.loc[left[0], 'ratio']:.3f})")
        window = " (a window of contiguous blocks, not a cumulative order)" * (
            order == "angular")
        found[order] = {
            "n_removed": int(r.n_removed), "removed": r.removed,
            "share_params": float(r.share_params), "perplexity": float(r.perplexity),
            "sentence": f"{order} order{window}: {int(r.n_removed)} of {n_layers} blocks "
            f"({r.share_params:.0%} of the parameters) can go with perplexity "
            f"{r.perplexity:,.2f} within +{tolerance:.0%} of the baseline {base:,.2f}"
            + (f", blocks {r.removed}" if r.removed else "") + exit}
    return found
