"""Edges and circuits (`sweeps.edges`, `experiments.circuit`), each held to a computation
written here or to TransformerLens's own: its `attribution_patch` at edge granularity and its
`faithfulness` (GPT-2, and Llama with as many key/value heads as heads: TransformerLens
refuses grouped queries), one edge patched by a hook written here, EAP-IG's first step and
completeness, and the circuit command's files. A writer's edges summing to its node
estimate, and the rewired run's two ends, are held on every family in
tests/model/test_families.py."""

import numpy as np
import pytest
import torch

from blockscope.experiments import circuit as circuit_exp
from blockscope.model.loading import load_model, spec_for
from blockscope.sweeps import edges
from blockscope.sweeps.metrics import LogitDiff

from ..builders import save_checkpoint

CLEAN = torch.tensor([[50256, 464, 3139, 286, 4881, 318]])  # BOS The capital of France is
CORRUPTED = torch.tensor([[50256, 464, 3139, 286, 8031, 318]])  # ... of Italy is
METRIC = LogitDiff(11, 22)
TL_KINDS = {"embed": "embed", "attn_head_out": "head", "mlp_out": "mlp", "q_input": "q",
            "k_input": "k", "v_input": "v", "mlp_in": "mlp", "logits": "logits"}


def load(family, tmp_path_factory, **overrides):
    d = save_checkpoint(family, tmp_path_factory.mktemp(family) / "m", **overrides)
    return load_model(spec_for(str(d), device="cpu"))


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def tl_model(request, tmp_path_factory):
    """A model TransformerLens's edges accept: Llama without grouped queries."""
    extra = {"num_key_value_heads": 4} if request.param == "llama" else {}
    return load(request.param, tmp_path_factory, **extra)


def tl_metric(logits):
    return logits[0, -1, METRIC.target] - logits[0, -1, METRIC.contrast]


def test_edges_equal_transformer_lens(tl_model):
    """Every edge equals TransformerLens 4's edge attribution summed over positions (its
    edges are per position), the graph the same edge for edge."""
    from transformer_lens.tools.analysis import attribution_patching as tl

    config = tl.EdgeAttributionConfig(granularity="edge")
    theirs = tl.attribution_patch(tl_model, CLEAN, CORRUPTED, tl_metric, config).edge_scores
    want: dict = {}
    for (w, r), score in theirs.items():
        key = (edges.Node(TL_KINDS[w.kind], w.layer, w.head),
               edges.Node(TL_KINDS[r.kind], r.layer, r.head))
        want[key] = want.get(key, 0.0) + score
    es = edges.scores(tl_model, CLEAN, CORRUPTED, METRIC)
    g = es.graph
    ours = {(g.writers[u], g.readers[v]): es.values[v, u] for v, u in g.edges()}
    assert set(ours) == set(want)
    got, ref = np.array([ours[k] for k in want]), np.array(list(want.values()))
    assert np.abs(ref).max() > 0.1
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_eap_ig_with_one_step_is_eap_and_its_embedding_edges_tend_to_the_whole_change(
        tmp_path_factory):
    """EAP-IG's path starts at the corrupted run: one step is EAP. The embedding's edges sum
    to its node estimate, whose integrated gradients tend to M(clean) - M(corrupted) as the
    steps grow (the path is the embedding's own: nothing else differs at block 0's input)."""
    model = load("gpt2", tmp_path_factory)
    eap = edges.scores(model, CLEAN, CORRUPTED, METRIC)
    one = edges.scores(model, CLEAN, CORRUPTED, METRIC, method="ig", steps=1)
    np.testing.assert_allclose(one.values, eap.values, rtol=0,
                               atol=1e-6 * np.abs(eap.values).max())
    gap = eap.source - eap.base
    errors = [abs(edges.scores(model, CLEAN, CORRUPTED, METRIC, method="ig", steps=m)
                  .values[:, 0].sum() - gap) for m in (4, 64)]
    assert errors[1] < errors[0] / 4 and errors[1] < 0.05 * abs(gap), (errors, gap)


def test_faithfulness_equals_transformer_lens(tl_model):
    """A circuit's faithfulness equals TransformerLens 4's ablate-outside faithfulness with
    the same edges at every position, for circuits of the top 3, 10 and 30 edges."""
    from transformer_lens.tools.analysis import attribution_patching as tl

    curve, ranked = circuit_exp.circuit(tl_model, CLEAN, CORRUPTED, target=METRIC.target,
                                        contrast=METRIC.contrast, method="atp")
    es = edges.scores(tl_model, CLEAN, CORRUPTED, METRIC)
    g = es.graph
    writer_kind = {"embed": "embed", "head": "attn_head_out", "mlp": "mlp_out"}
    reader_kind = {"q": "q_input", "k": "k_input", "v": "v_input", "mlp": "mlp_in",
                   "logits": "logits"}
    for n in (3, 10, 30):
        kept = []
        for r in ranked.head(n).itertuples():
            w = next(x for x in g.writers if x.name == r.writer)
            d = next(x for x in g.readers if x.name == r.reader)
            for p in range(CLEAN.shape[-1]):
                kept.append((tl.Node(writer_kind[w.kind], p, w.layer, w.head),
                             tl.Node(reader_kind[d.kind], p, d.layer, d.head)))
        want = tl.faithfulness(tl_model, CLEAN, CORRUPTED, tl_metric, kept).recovered
        keep = np.zeros_like(g.valid)
        pairs = g.edges()
        order = np.argsort(-np.abs([es.values[p] for p in pairs]), kind="stable")
        for i in order[:n]:
            keep[pairs[i]] = True
        got = edges.rewired(tl_model, CLEAN, g, g.valid & ~keep, es.replacement, METRIC)
        got = (got - es.base) / (es.source - es.base)
        assert got == pytest.approx(want, abs=1e-4), n
        if n in set(curve["n_edges"]):
            assert curve.set_index("n_edges").loc[n, "faithfulness"] == pytest.approx(got)


def test_one_edge_patched_exactly_equals_a_hook_written_here(tmp_path_factory):
    """The check's exact value of an edge: the corrupted run whose reader (one head's query
    input, an MLP's input) reads the clean writer instead of its own, by a hook written here
    on the bridge's per-head inputs."""
    model = load("gpt2", tmp_path_factory)
    es = edges.scores(model, CLEAN, CORRUPTED, METRIC)
    g = es.graph

    def by_hand(writer, reader):
        hook = {"q": f"blocks.{reader.layer}.attn.hook_q_input",
                "mlp": f"blocks.{reader.layer}.hook_mlp_in"}[reader.kind]
        src = (f"blocks.{writer.layer}.attn.hook_result" if writer.kind == "head" else
               f"blocks.{writer.layer}.hook_mlp_out")
        delta = es.clean_writers[src] - es.replacement[src]
        if writer.kind == "head":
            delta = delta[:, :, writer.head]

        def fn(act, hook=None):
            act = act.clone()
            if reader.kind == "q":
                act[:, :, reader.head] += delta
            else:
                act += delta
            return act

        with edges.per_head_hooks(model), torch.no_grad(), model.hooks(fwd_hooks=[(hook, fn)]):
            logits = model(CORRUPTED, return_type="logits")[:, -1]
        return float(METRIC(logits.float())[0])

    for writer, reader in [(edges.Node("head", 0, 1), edges.Node("q", 1, 2)),
                           (edges.Node("mlp", 0), edges.Node("mlp", 1))]:
        v, u = g.readers.index(reader), g.writers.index(writer)
        one = np.zeros_like(g.valid)
        one[v, u] = True
        got = edges.rewired(model, CORRUPTED, g, one, es.clean_writers, METRIC)
        assert got == pytest.approx(by_hand(writer, reader), abs=1e-5)
        assert got != pytest.approx(es.base, abs=1e-4)  # the edge carries something


def test_the_circuit_command(tiny_dir, tmp_path):
    """`blockscope circuit` writes the curve and the ranked edges; the smallest circuit is
    the first size on the curve to reach the threshold after every smaller size tried fell
    short, and the edges CSV marks it."""
    import json

    import pandas as pd
    from typer.testing import CliRunner

    from blockscope.cli import app

    from ..conftest import result

    res = CliRunner().invoke(app, ["circuit", "--clean", "The capital of France is",
                                   "--corrupted", "The capital of Italy is", "--target",
                                   " Paris", "--contrast", " Rome", "--method", "atp",
                                   "--model", str(tiny_dir), "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    curve = pd.read_csv(result(tmp_path, "circuit-tiny-gpt2.csv"))
    ranked = pd.read_csv(result(tmp_path, "circuit-tiny-gpt2-edges.csv"))
    meta = json.loads(result(tmp_path, "circuit-tiny-gpt2.json").read_text())
    assert curve["faithfulness"].iloc[-1] == pytest.approx(1.0, abs=1e-4)  # every edge kept
    assert curve["n_edges"].iloc[-1] == meta["total_edges"] == len(ranked)
    n = meta["smallest"]
    if n is not None:
        at = curve.set_index("n_edges")["faithfulness"]
        assert at[n] >= 0.8 and all(at[k] < 0.8 for k in at.index if k < n and
                                    curve.set_index("n_edges").loc[k, "on_grid"])
        assert ranked["in_circuit"].sum() == n
    assert (ranked["estimate"].abs().diff().dropna() <= 1e-12).all()  # ranked
    assert "smallest circuit" in res.stdout or "No circuit" in res.stdout
    assert result(tmp_path, "circuit-tiny-gpt2.png").stat().st_size > 0
