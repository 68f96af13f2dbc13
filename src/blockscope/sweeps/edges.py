"""The residual stream as a graph: edge attribution patching (EAP, EAP-IG) and circuits whose
faithfulness is measured by patching.

At each position the stream a component reads is a sum of what earlier components wrote.
- Writers: the token embedding (the position embedding is the same in two prompts of one
  length, and cancels), each head's write (`attn.hook_result`, d_model a head), each MLP's
  write (`hook_mlp_out`).
- Readers: each head's query, key and value input (`attn.hook_q_input`, ..., one copy of
  the stream a head; keys and values one a key/value head), each MLP's input
  (`hook_mlp_in`), and the logits (the last block's output).
- An edge u -> v joins a writer to a reader after it: the embedding and every earlier
  block's writes feed a block's heads; the same block's heads feed its MLP too, unless the
  block runs them in parallel; everything feeds the logits. An edge is scored over every
  position at once (Syed et al.'s EAP, Hanna et al.'s EAP-IG, which sum positions).

Estimate (`scores`): (a_clean[u] - a_corrupted[u]) . dM/d(input of v), the gradient on the
corrupted run (`atp`) or averaged along the input path (`ig`), as `attribution` takes them.
A writer's edges sum to its node estimate (the logits edge carries its direct part).

Exact (`rewired`): one forward in which each reader's input is its own minus, for chosen
edges, w * (live_u - replacement_u): the stream at a reader is a plain sum of writers (and
constants that cancel), so this is the forward with those edges patched, not an estimate.
A circuit's faithfulness: the clean run with every edge outside it given the corrupted
run's writer, as a share of the clean - corrupted gap. One edge's exact effect: the
corrupted run with that edge given the clean run's writer.

The bridge's per-head hooks are off by default; `per_head_hooks` turns them on for the body
of a `with` and restores them however it ends. Where a head's write is not its share of
the attention output (a norm or scale after the heads' sum), edges are refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from blockscope.errors import BlockscopeError
from blockscope.interventions import applied
from blockscope.interventions.interchange import heads_at
from blockscope.sweeps.attribution import gradients, metric_of

HEAD_SUM_RTOL = 1e-4  # float32 sums of a few heads, far below any norm's or scale's effect


@dataclass(frozen=True)
class Node:
    """A writer ("embed", "head", "mlp") or a reader ("q", "k", "v", "mlp", "logits") of the
    stream; `head` a key/value head for "k" and "v" readers."""

    kind: str
    layer: int | None = None
    head: int | None = None

    @property
    def name(self) -> str:
        """As the tables name it: embed, a3.1 (head 1 of block 3), m3, q3.1, k3.0, logits."""
        if self.kind in ("embed", "logits"):
            return self.kind
        short = {"head": "a", "mlp": "m"}.get(self.kind, self.kind)
        return f"{short}{self.layer}" + ("" if self.head is None else f".{self.head}")


@dataclass
class Graph:
    """Every writer and reader, in the order the forward meets them, and which edges
    exist: `valid` (readers, writers)."""

    writers: list[Node]
    readers: list[Node]
    valid: np.ndarray

    @property
    def n_edges(self) -> int:
        return int(self.valid.sum())

    def edges(self) -> list[tuple[int, int]]:
        """(reader index, writer index) of every edge, readers in order."""
        v, u = np.nonzero(self.valid)
        return list(zip(v.tolist(), u.tolist(), strict=True))


def graph(cfg, parallel: bool) -> Graph:
    """The graph of a model of config `cfg`, its blocks parallel or not."""
    n_kv = heads_at(cfg, "attn.hook_k")
    writers, readers, avail = [Node("embed")], [], [0]
    rows = []
    for layer in range(cfg.n_layers):
        heads = [Node("head", layer, h) for h in range(cfg.n_heads)]
        for kind, n in (("q", cfg.n_heads), ("k", n_kv), ("v", n_kv)):
            for h in range(n):
                readers.append(Node(kind, layer, h))
                rows.append(list(avail))
        first = len(writers)
        writers += heads
        own = list(range(first, len(writers)))
        readers.append(Node("mlp", layer))
        rows.append(list(avail) if parallel else avail + own)
        avail = avail + own
        writers.append(Node("mlp", layer))
        avail = avail + [len(writers) - 1]
    readers.append(Node("logits", cfg.n_layers - 1))
    rows.append(list(avail))
    valid = np.zeros((len(readers), len(writers)), dtype=bool)
    for v, us in enumerate(rows):
        valid[v, us] = True
    return Graph(writers, readers, valid)


@contextmanager
def per_head_hooks(model) -> Iterator[None]:
    """The bridge's per-head hooks on (each head's write, each head's own copy of its
    inputs, the MLP's input), restored however the body ends."""
    cfg = model.cfg
    saved = (cfg.use_attn_result, cfg.use_split_qkv_input, cfg.use_hook_mlp_in,
             bool(getattr(cfg, "use_attn_in", False)))
    try:
        try:
            if saved[3]:
                model.set_use_attn_in(False)  # exclusive with the split inputs
            model.set_use_attn_result(True)
            model.set_use_split_qkv_input(True)
            model.set_use_hook_mlp_in(True)
        except (NotImplementedError, ValueError) as exc:
            raise BlockscopeError(
                "TransformerLens's bridge has no per-head hooks for this model's attention "
                "(each head's write and its own inputs), which edges need: "
                + str(exc).split(".")[0]) from None
        yield
    finally:
        model.set_use_attn_result(saved[0])
        model.set_use_split_qkv_input(saved[1])
        model.set_use_hook_mlp_in(saved[2])
        if saved[3]:
            model.set_use_attn_in(True)


def writer_names(n_layers: int) -> list[str]:
    return ["hook_embed", *[f"blocks.{j}.{p}" for j in range(n_layers)
                            for p in ("attn.hook_result", "hook_mlp_out")]]


def reader_names(n_layers: int) -> list[str]:
    return [*[f"blocks.{j}.{p}" for j in range(n_layers)
              for p in ("attn.hook_q_input", "attn.hook_k_input", "attn.hook_v_input",
                        "hook_mlp_in")], f"blocks.{n_layers - 1}.hook_resid_post"]


def _reader_hook(node: Node, n_layers: int) -> str:
    if node.kind == "logits":
        return f"blocks.{n_layers - 1}.hook_resid_post"
    if node.kind == "mlp":
        return f"blocks.{node.layer}.hook_mlp_in"
    return f"blocks.{node.layer}.attn.hook_{node.kind}_input"


def _writer_hook(node: Node) -> str:
    if node.kind == "embed":
        return "hook_embed"
    return f"blocks.{node.layer}." + ("attn.hook_result" if node.kind == "head" else
                                      "hook_mlp_out")


def stack(acts: dict, nodes: list[Node], hook_of) -> torch.Tensor:
    """Each node's (T, d_model) slice of one run's activations (batch row 0): (nodes, T, d)."""
    return torch.stack([acts[hook_of(n)][0] if n.head is None else acts[hook_of(n)][0, :, n.head]
                        for n in nodes])


def check_additive(model, acts: dict) -> None:
    """Refuse a model whose heads' writes do not sum to its attention output (plus a constant
    the runs share): there an edge from a head is not what the stream receives."""
    for j in range(model.cfg.n_layers):
        written = acts[f"blocks.{j}.hook_attn_out"][0].double()
        rest = written - acts[f"blocks.{j}.attn.hook_result"][0].double().sum(1)
        rest = rest - rest.mean(0, keepdim=True)
        if float(rest.norm()) > HEAD_SUM_RTOL * float(written.norm()) + 1e-6:
            raise BlockscopeError(
                f"block {j}'s attention output is not the sum of its heads' writes (off by "
                f"{float(rest.norm() / written.norm()):.1e} of its size): edges from heads "
                "are not what the stream receives in this model")


@dataclass
class EdgeScores:
    """Every edge's estimate (readers, writers; 0 off the graph), and the runs' metric."""

    graph: Graph
    values: np.ndarray
    base: float  # M(corrupted)
    source: float  # M(clean)
    replacement: dict  # writer hook -> the corrupted run's activation (what patches write)
    clean_writers: dict  # writer hook -> the clean run's activation
    how: dict = field(default_factory=dict)


def _capture(model, tokens, names) -> tuple[dict, torch.Tensor]:
    acts = {}

    def keep(name):
        def hook(act, hook=None):
            acts[name] = act.detach().clone()
        return hook

    _passes(model, names)
    with torch.inference_mode(), applied(model, [(n, keep(n)) for n in names]):
        logits = model(tokens.to(model.cfg.device), return_type="logits")[:, -1].float()
    _passed(names, acts)
    return acts, logits


def _passes(model, names) -> None:
    """Refuse, in one line, where the bridge lacks a hook point edges need."""
    missing = [n for n in names if n not in model.hook_dict]
    if missing:
        raise BlockscopeError(f"this model's bridge has no {missing[0]} (and {len(missing) - 1} "
                              "more hook points edges need)" if len(missing) > 1 else
                              f"this model's bridge has no {missing[0]}, which edges need")


def _passed(names, seen) -> None:
    """Refuse, in one line, where the forward did not pass a hook point edges read."""
    missing = [n for n in names if n not in seen]
    if missing:
        raise BlockscopeError(f"this model's forward does not pass {missing[0]}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                              + ": its bridge does not route the stream through the per-head "
                              "hooks edges need")


def scores(model, clean: torch.Tensor, corrupted: torch.Tensor, metric, *,
           method: str = "atp", steps: int = 1, rows: int = 8) -> EdgeScores:
    """Every edge's estimated effect of writing the clean run's writer into the corrupted
    run at that reader alone (see the module)."""
    from blockscope.model.arch import layout

    if method not in ("atp", "ig"):
        raise ValueError("edges are estimated by atp or ig")
    lay = layout(model)
    if lay.post_norms:
        raise BlockscopeError(f"{lay.family} normalises each sublayer's output before the "
                              "stream: a head's write is not what the stream receives")
    started = time.perf_counter()
    cfg = model.cfg
    g = graph(cfg, lay.parallel)
    n = cfg.n_layers
    readers = reader_names(n)
    with per_head_hooks(model):
        names = [*writer_names(n), *[f"blocks.{j}.hook_attn_out" for j in range(n)],
                 "blocks.0.hook_resid_pre"]
        clean_acts, clean_logits = _capture(model, clean, names)
        check_additive(model, clean_acts)
        corr_acts, corr_logits = _capture(model, corrupted, names)
        path = (corr_acts["blocks.0.hook_resid_pre"], clean_acts["blocks.0.hook_resid_pre"]
                ) if method == "ig" else None
        _passes(model, readers)
        grads, _, _ = gradients(model, corrupted, readers, metric, path=path, steps=steps,
                                rows=rows)
    deltas = (stack(clean_acts, g.writers, _writer_hook)
              - stack(corr_acts, g.writers, _writer_hook))  # (U, T, d)
    reads = stack(grads, g.readers, lambda v: _reader_hook(v, n))  # (V, T, d)
    values = torch.einsum("vtd,utd->vu", reads.double(), deltas.double()).cpu().numpy()
    values[~g.valid] = 0.0
    points = steps if method == "ig" else 1
    how = {"method": method, "steps": steps if method == "ig" else None,
           "forwards": 2 + points, "backwards": points,
           "edges": g.n_edges, "seconds": round(time.perf_counter() - started, 3)}
    return EdgeScores(g, values, float(metric_of(metric, corr_logits)[0]),
                      float(metric_of(metric, clean_logits)[0]),
                      {k: corr_acts[k] for k in writer_names(n)},
                      {k: clean_acts[k] for k in writer_names(n)},
                      {k: v for k, v in how.items() if v is not None})


def writers(model, tokens: torch.Tensor) -> dict:
    """One run's writers' activations (hook -> act): what `rewired` writes from."""
    with per_head_hooks(model):
        acts, _ = _capture(model, tokens, writer_names(model.cfg.n_layers))
    return acts


def rewired(model, tokens: torch.Tensor, g: Graph, weights: np.ndarray, replacement: dict,
            metric) -> float:
    """M of the run of `tokens` in which each reader v reads its own input plus, for each
    writer u, weights[v, u] * (replacement_u - live_u): `weights` (readers, writers) 1 on
    the edges patched, 0 elsewhere; `replacement` the other run's writers (hook -> act).
    Exact: the stream a reader receives is the sum of the writers' live outputs."""
    n = model.cfg.n_layers
    w = torch.as_tensor(weights & g.valid, dtype=torch.float32)
    live: dict[str, torch.Tensor] = {}
    by_hook: dict[str, list[int]] = {}
    for v, node in enumerate(g.readers):
        by_hook.setdefault(_reader_hook(node, n), []).append(v)
    users = np.nonzero(weights.any(0))[0]  # writers some patched edge reads

    def keep(name):
        def hook(act, hook=None):
            live[name] = act
        return hook

    def rebuild(name, vs):
        rows = w[vs][:, users]  # (readers here, writers used)

        def hook(act, hook=None):
            if not bool(rows.any()):
                return act
            have = [i for i, u in enumerate(users) if _writer_hook(g.writers[u]) in live]
            if not have:
                return act
            diff = torch.stack([_slice(replacement, g.writers[users[i]])
                                - _slice(live, g.writers[users[i]]) for i in have])
            change = torch.einsum("vu,utd->vtd", rows[:, have].to(diff.dtype), diff)
            act = act.clone()
            if act.dim() == 4:  # (1, T, heads, d): one reader a head, in order
                act[0] += change.transpose(0, 1)
            else:
                act[0] += change[0]
            return act
        return hook

    hooks_ = [(name, keep(name)) for name in writer_names(n)]
    hooks_ += [(name, rebuild(name, vs)) for name, vs in by_hook.items()]
    with per_head_hooks(model), torch.inference_mode(), applied(model, hooks_):
        logits = model(tokens.to(model.cfg.device), return_type="logits")[:, -1].float()
    return float(metric_of(metric, logits)[0])


def _slice(acts: dict, node: Node) -> torch.Tensor:
    act = acts[_writer_hook(node)][0]
    return act if node.head is None else act[:, node.head]
