"""Attribution patching (`sweeps.attribution`, `experiments.attribute`), each estimate held
to a computation written here or to TransformerLens's own: TransformerLens 4's
`attribution_patch` and its backward-hook gradients (GPT-2, Llama with grouped-query
attention), a model that is linear after the patched site, the integrated gradients'
completeness, GradDrop's zeroing by plain HF hooks, and `patch`'s exact cells."""

import copy
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import transformers

from blockscope.experiments import attribute as attribute_exp
from blockscope.experiments import patch as patch_exp
from blockscope.interventions.interchange import Edit, Patch, Site, heads_at
from blockscope.model.loading import load_model, spec_for
from blockscope.sweeps import attribution
from blockscope.sweeps.interchange import Run, capture
from blockscope.sweeps.metrics import LogitDiff
from blockscope.sweeps.settings import RunSettings
from blockscope.sweeps.variant import Variant

from ..builders import save_checkpoint
from ..references import hf_run

CLEAN = torch.tensor([[50256, 464, 3139, 286, 4881, 318]])  # BOS The capital of France is
CORRUPTED = torch.tensor([[50256, 464, 3139, 286, 8031, 318]])  # ... of Italy is
SITES = list(patch_exp.SITES)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request, tmp_path_factory):
    """The bridge, the plain HF model, and the target and contrast: the tokens the corruption
    moves most, up and down (a random model knows no capital)."""
    d = save_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "m")
    model = load_model(spec_for(str(d), device="cpu"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
    moved = hf_run(hf, CLEAN, []) - hf_run(hf, CORRUPTED, [])
    return model, hf, int(moved.argmax()), int(moved.argmin())


def estimates(model, target, contrast, method="atp", steps=1, sites=SITES):
    grid = patch_exp.variants(model.cfg, CLEAN.shape[-1], sites)
    est = attribution.estimate(model, Run(CORRUPTED), {"clean": Run(CLEAN)}, grid,
                               LogitDiff(target, contrast), method=method, steps=steps)
    return grid, est


def test_atp_equals_transformer_lens(pair):
    """Every cell equals TransformerLens 4's attribution patching: its node scores for heads
    (per position, summed over positions: z patches a head at every position) and MLP
    outputs, and for the residual stream, attention outputs and each head's query, key and
    value (a key/value head of Llama's groups), its own gradient cache (backward hooks)
    contracted here. Both take the gradient on the corrupted run and point
    to the clean one, so the signs agree as they are."""
    from transformer_lens.tools.analysis import attribution_patching as tl

    model, _, target, contrast = pair
    grid, est = estimates(model, target, contrast)

    def metric(logits):
        return logits[0, -1, target] - logits[0, -1, contrast]

    nodes = tl.attribution_patch(model, CLEAN, CORRUPTED, metric).node_scores
    names = [f"blocks.{i}.{p}" for i in range(model.cfg.n_layers)
             for p in ("hook_resid_pre", "hook_attn_out", "attn.hook_q", "attn.hook_k",
                       "attn.hook_v")]
    clean = tl.cache_activation_and_gradient(model, CLEAN, metric, names, compute_gradient=False)
    corrupt = tl.cache_activation_and_gradient(model, CORRUPTED, metric, names)
    want = []
    for v in grid:
        site, layer, head, pos = (v.label[k] for k in ("site", "layer", "head", "position"))
        if site == "z":
            want.append(sum(nodes[tl.Node("attn_head_out", p, layer, head)]
                            for p in range(CLEAN.shape[-1])))
        elif site == "mlp-out":
            want.append(nodes[tl.Node("mlp_out", pos, layer)])
        else:  # the stream sites at one position; q, k and v one head at every position
            name = f"blocks.{layer}.{patch_exp.SITES[site]}"
            delta = clean.activations[name] - corrupt.activations[name]
            cell = (0, pos) if head is None else (0, slice(None), head)
            want.append(float((delta * corrupt.gradients[name])[cell].sum()))
    want = np.array(want)
    assert np.abs(want).max() > 0.1  # the corruption moves the metric through many cells
    np.testing.assert_allclose(est.values, want, rtol=0, atol=1e-5 * np.abs(want).max())


@dataclass(frozen=True)
class Half:
    """A user's intervention, not declared elementwise: half of each value."""

    def apply(self, base, source=None):
        return 0.5 * base


def test_any_intervention_is_estimated_by_what_its_apply_writes(pair):
    """The estimate reads an edit's apply, not its class: a user's Half on one head's z is
    -0.5 z . dM/dz (TransformerLens's gradient cache, contracted here), and a patch whose
    source is the clean activation as a tensor (applied to its own selection) equals the
    same patch read from the clean run (applied once to the whole site)."""
    from transformer_lens.tools.analysis import attribution_patching as tl

    model, _, target, contrast = pair
    metric = LogitDiff(target, contrast)
    name = "blocks.1.attn.hook_z"
    corrupt = tl.cache_activation_and_gradient(  # an upstream point too: its backward hook
        model, CORRUPTED, lambda lg: lg[0, -1, target] - lg[0, -1, contrast],  # then fires
        [name, "blocks.0.hook_resid_pre"])
    clean = capture(model, Run(CLEAN), [name]).acts[name]
    halves = [Variant({"head": h}, (Edit(Site("attn.hook_z", 1, head=h), Half()),))
              for h in range(model.cfg.n_heads)]
    tensors = [Variant({"head": h}, (Edit(Site("attn.hook_z", 1, head=h), Patch(),
                                          clean[:, :, h]),)) for h in range(model.cfg.n_heads)]
    named = [Variant({"head": h}, (Edit(Site("attn.hook_z", 1, head=h), Patch(), "clean"),))
             for h in range(model.cfg.n_heads)]
    got = attribution.estimate(model, Run(CORRUPTED), {"clean": Run(CLEAN)},
                               halves + tensors + named, metric).values
    h = model.cfg.n_heads
    want = [-0.5 * float((corrupt.activations[name] * corrupt.gradients[name])[0, :, i].sum())
            for i in range(h)]
    scale = max(abs(w) for w in want)
    np.testing.assert_allclose(got[:h], want, rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(got[h:2 * h], got[2 * h:], rtol=0, atol=1e-9 * max(
        1.0, np.abs(got[2 * h:]).max()))


def test_ig_with_one_step_is_atp_and_tends_to_the_whole_change(pair):
    """IG's left Riemann sum starts at the corrupted run, so one step is AtP. Summed over
    every position of block 0's input (the path's own coordinates), IG is a Riemann sum of
    the metric's derivative along the path: its error against M(clean) - M(corrupted) falls
    as 1/m (completeness), by about half or more each time m doubles twice."""
    model, _, target, contrast = pair
    _, atp = estimates(model, target, contrast)
    _, ig1 = estimates(model, target, contrast, "ig", 1)
    np.testing.assert_allclose(ig1.values, atp.values, rtol=0,
                               atol=1e-6 * np.abs(atp.values).max())
    gap = atp.sources["clean"] - atp.base
    errors = []
    for m in (4, 16, 64):
        grid, ig = estimates(model, target, contrast, "ig", m, sites=["resid-pre"])
        block0 = [i for i, v in enumerate(grid) if v.label["layer"] == 0]
        errors.append(abs(ig.values[block0].sum() - gap))
    assert errors[2] < errors[1] / 2 < errors[0] / 4, errors
    assert errors[2] < 0.05 * abs(gap), (errors, gap)
    # the points go through in batches of `rows`: the mean is the same however they are cut
    cap = capture(model, Run(CLEAN), ["blocks.0.hook_resid_pre"])
    base = capture(model, Run(CORRUPTED), ["blocks.0.hook_resid_pre"])
    path = (base.acts["blocks.0.hook_resid_pre"], cap.acts["blocks.0.hook_resid_pre"])
    names = ["blocks.1.hook_resid_pre", "blocks.0.attn.hook_z"]
    cut = [attribution.gradients(model, CORRUPTED, names, LogitDiff(target, contrast),
                                 path=path, steps=7, rows=rows)[0] for rows in (3, 7)]
    for name in names:
        torch.testing.assert_close(cut[0][name], cut[1][name], rtol=1e-5, atol=1e-6)


def test_atp_is_exact_where_nothing_after_the_site_is_nonlinear(tmp_path):
    """With the final norm's epsilon far above the residual's variance, the final LayerNorm
    is linear to 1e-12, and so is everything after the last block's MLP output: AtP there
    equals exact patching, to float32 rounding. (A nonlinear model would differ at once:
    the same cells with the default epsilon miss by far more.)"""
    d = save_checkpoint("gpt2", tmp_path / "m", n_layer=2)
    model = load_model(spec_for(str(d), device="cpu"))
    last = model.cfg.n_layers - 1
    target, contrast = 11, 22

    def misses():
        df = attribute_exp.attribute(model, CLEAN, CORRUPTED, target=target, contrast=contrast,
                                     sites=["mlp-out"], check=None,
                                     settings=RunSettings(engine="naive"))
        cells = df[df["layer"] == last]
        change = cells["exact_logit_diff"] - df.attrs["corrupted"]
        return (cells["estimate"] - change).abs().max(), change.abs().max()

    nonlinear, scale = misses()
    norm, config = model.ln_final, model.ln_final.config  # the bridge's norm reads its eps
    try:
        norm.config = copy.copy(config)
        norm.config.eps = 1e12
        linear, tiny = misses()
    finally:
        norm.config = config
    assert tiny > 0
    assert linear <= 1e-4 * tiny, (linear, tiny)
    assert nonlinear > 1e-2 * scale, (nonlinear, scale)


def test_the_qk_fix_patches_one_head_through_its_attention_and_linearises_after(pair):
    """AtP*'s QK fix, for each head's query and each key head's key: the pattern of its block
    with that head's query (or key) alone written from the clean run, by a hook written
    here; then (A' - A) . dM/dA over every head, the gradient from a leaf added to the
    pattern here. A key head of Llama's groups reaches its whole group of query heads; the
    other cells are AtP's, unchanged."""
    model, _, target, contrast = pair
    sites = ["q", "k", "v", "z"]
    grid, star = estimates(model, target, contrast, "atp-star", sites=sites)
    _, atp = estimates(model, target, contrast, sites=sites)

    def metric(logits):
        return logits[0, -1, target] - logits[0, -1, contrast]

    def run(tokens, hooks):
        with model.hooks(fwd_hooks=hooks):
            return model(tokens, return_type="logits")

    def keep(store, key):
        def hook(act, hook=None):
            store[key] = act.detach().clone()
        return hook

    clean, corrupt = {}, {}
    for j in range(model.cfg.n_layers):
        for point in ("attn.hook_q", "attn.hook_k", "attn.hook_pattern"):
            with torch.no_grad():
                run(CLEAN, [(f"blocks.{j}.{point}", keep(clean, (j, point)))])
                run(CORRUPTED, [(f"blocks.{j}.{point}", keep(corrupt, (j, point)))])
    leaves = {}

    def leaf(j):
        def hook(act, hook=None):
            leaves[j] = torch.zeros_like(act, requires_grad=True)
            return act + leaves[j]
        return hook

    value = metric(run(CORRUPTED, [(f"blocks.{j}.attn.hook_pattern", leaf(j))
                                   for j in range(model.cfg.n_layers)]))
    grads = dict(zip(leaves, torch.autograd.grad(value, list(leaves.values())), strict=True))
    checked = 0
    for i, v in enumerate(grid):
        site, j, h = v.label["site"], v.label["layer"], v.label["head"]
        if site not in ("q", "k"):
            assert star.values[i] == pytest.approx(atp.values[i], rel=1e-6, abs=1e-9)
            continue
        point = f"attn.hook_{site}"

        def one_head(act, hook=None, src=clean[(j, point)], h=h):
            act = act.clone()
            act[:, :, h] = src[:, :, h]
            return act

        seen = {}
        with torch.no_grad():
            run(CORRUPTED, [(f"blocks.{j}.{point}", one_head),
                            (f"blocks.{j}.attn.hook_pattern", keep(seen, "A"))])
        want = float(((seen["A"] - corrupt[(j, "attn.hook_pattern")]) * grads[j]).sum())
        assert star.values[i] == pytest.approx(want, rel=1e-4, abs=1e-6), (v.label, want)
        checked += 1
    assert checked == model.cfg.n_layers * (model.cfg.n_heads + heads_at(model.cfg,
                                                                          "attn.hook_k"))
    # the fix matters: saturated or not, a softmax is not its tangent
    qk = np.array([v.label["site"] in ("q", "k") for v in grid])
    assert np.abs(star.values[qk] - atp.values[qk]).max() > 1e-3


def test_graddrop_equals_hf_hooks_written_here(pair):
    """GradDrop: for each block l, AtP with block l's attention and MLP outputs detached
    (plain HF forward hooks here, after the leaves the gradients are read from, so that a
    site of block l gets none), then the sum of the absolute estimates over L - 1, at each
    block's attention and MLP output."""
    model, hf, target, contrast = pair
    sites = ["attn-out", "mlp-out"]
    grid, est = estimates(model, target, contrast, "atp-star", sites=sites)
    layers = hf.model.layers if hasattr(hf, "model") else hf.transformer.h
    parts = [(block.self_attn if hasattr(block, "self_attn") else block.attn, block.mlp)
             for block in layers]

    def outputs(ids, drop=None, leaves=None):
        seen, handles = {}, []
        for i, (attn, mlp) in enumerate(parts):
            for name, mod in (("attn-out", attn), ("mlp-out", mlp)):
                def hook(m, a, out, key=(name, i)):
                    t = out[0] if isinstance(out, tuple) else out
                    if leaves is not None:
                        t = t + leaves[key]
                    seen[key] = t
                    if drop == key[1]:
                        t = t.detach()
                    return (t, *out[1:]) if isinstance(out, tuple) else t
                handles.append(mod.register_forward_hook(hook))
        try:
            logits = hf(ids).logits[0, -1]
        finally:
            for h in handles:
                h.remove()
        return seen, logits[target] - logits[contrast]

    with torch.no_grad():
        clean, _ = outputs(CLEAN)
        corrupt, _ = outputs(CORRUPTED)
    total = np.zeros(len(grid))
    for drop in range(len(parts)):
        leaves = {k: torch.zeros_like(v, requires_grad=True) for k, v in corrupt.items()}
        _, value = outputs(CORRUPTED, drop, leaves)
        grads = dict(zip(leaves, torch.autograd.grad(value, list(leaves.values()),
                                                      allow_unused=True), strict=True))
        for i, v in enumerate(grid):
            key, pos = (v.label["site"], v.label["layer"]), v.label["position"]
            g = grads[key]
            score = 0.0 if g is None else float(((clean[key] - corrupt[key]) * g)[0, pos].sum())
            total[i] += abs(score)
    want = total / (len(parts) - 1)  # each site's own block gives 0: the paper's L - 1
    np.testing.assert_allclose(est.bound, want, rtol=0, atol=1e-5 * want.max())


def test_the_checked_cells_are_patchs_cells(pair):
    """The exact values beside the estimates are `patch`'s cells: equal, for every cell
    (--check all) and for the chosen ones; the chosen are the largest |estimates| of each
    site and a seeded draw of the rest. Each engine once: the cached on GPT-2, the naive
    on Llama."""
    model, _, target, contrast = pair
    engine = "naive" if model.cfg.n_key_value_heads else "cached"  # Llama: grouped
    settings = RunSettings(engine=engine)
    want = patch_exp.patch(model, CLEAN, CORRUPTED, target=target, contrast=contrast,
                           sites=SITES, settings=settings)
    every = attribute_exp.attribute(model, CLEAN, CORRUPTED, target=target, contrast=contrast,
                                    sites=SITES, check=None, settings=settings)
    assert (every[["site", "layer", "head", "position", "token"]]
            .equals(want[["site", "layer", "head", "position", "token"]]))
    assert (every["exact_logit_diff"] == want["logit_diff"]).all()
    np.testing.assert_allclose(every["exact_normalized"], want["normalized"], rtol=1e-12)
    some = attribute_exp.attribute(model, CLEAN, CORRUPTED, target=target, contrast=contrast,
                                   sites=SITES, check=2, seed=3, settings=settings)
    rows = some["checked"] != ""
    if engine == "naive":  # one forward per cell: the same floats whatever else ran
        assert (some.loc[rows, "exact_logit_diff"] == want.loc[rows, "logit_diff"]).all()
    else:  # another batch of variants: the same to float32 rounding
        np.testing.assert_allclose(some.loc[rows, "exact_logit_diff"],
                                   want.loc[rows, "logit_diff"], rtol=0, atol=1e-5)
    inert = np.array(some.attrs["inert"])
    before = some["position"].fillna(99) < 4  # the prompts agree before " France"/" Italy"
    assert inert[before.to_numpy()].all() and not inert.all()
    for _, part in some[~inert].groupby("site"):
        top = part["estimate"].abs().nlargest(2).index
        assert set(part.index[part["checked"] == "top"]) == set(top)
        assert (part["checked"] == "random").sum() == min(2, len(part) - 2)
    assert (some.loc[inert, "checked"] != "random").all()  # an inert cell is never drawn
    assert some["exact_logit_diff"].isna().sum() == (~rows).sum()
    again = attribute_exp.attribute(model, CLEAN, CORRUPTED, target=target, contrast=contrast,
                                    sites=SITES, check=2, seed=3, settings=settings)
    assert (again["checked"] == some["checked"]).all()  # the draw is the seed's


def test_the_command_and_the_face(tiny_dir, tmp_path):
    """`blockscope attribute` writes its CSV (patch's keys, the estimate, the check), a
    sidecar with the sign convention and the agreement per site, and a scatter; with
    atp-star, the GradDrop column ranks the checked cells. (The Python face's table is
    held to this CSV in tests/api/test_face.py.)"""
    import json

    import pandas as pd
    from typer.testing import CliRunner

    from blockscope.cli import app

    from ..conftest import result

    args = ["--clean", "The capital of France is", "--corrupted", "The capital of Italy is",
            "--target", " Paris", "--contrast", " Rome"]
    res = CliRunner().invoke(app, ["attribute", *args, "--site", "resid-pre", "--site", "z",
                                   "--check", "3", "--method", "ig", "--ig-steps", "2",
                                   "--model", str(tiny_dir), "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "How far to trust ig" in res.stdout
    df = pd.read_csv(result(tmp_path, "attribute-tiny-gpt2.csv"), keep_default_na=False,
                     na_values=[""])
    assert list(df.columns) == ["site", "layer", "head", "position", "token", "estimate",
                                "normalized", "checked", "exact_logit_diff",
                                "exact_normalized"]
    assert (df["checked"].fillna("").isin(["top", "random", ""])).all()
    # a head is patched at every position, " France" among them: 3 top, 3 random
    assert df.loc[df["site"] == "z", "checked"].count() == 6
    meta = json.loads(result(tmp_path, "attribute-tiny-gpt2.json").read_text())
    assert meta["method"] == "ig" and meta["ig_steps"] == 2 and "left Riemann" in meta["path_rule"]
    assert "gradient is taken on the base run" in meta["sign"]
    assert set(meta["agreement"]) == {"resid-pre", "z"}
    assert meta["agreement"]["z"]["checked"] == 6
    assert meta["attribution"]["backwards"] == 2 and meta["engine"] == "cached"
    assert result(tmp_path, "attribute-tiny-gpt2.png").stat().st_size > 0
    res = CliRunner().invoke(app, ["attribute", *args, "--site", "k", "--check", "2",
                                   "--method", "atp-star", "--model", str(tiny_dir),
                                   "--out-dir", str(tmp_path / "star")])
    assert res.exit_code == 0, res.output
    star = pd.read_csv(result(tmp_path / "star", "attribute-tiny-gpt2.csv"),
                       keep_default_na=False, na_values=[""])
    assert list(star.columns)[5:8] == ["estimate", "normalized", "graddrop"]
    assert (star["graddrop"] >= 0).all()
    top = star["graddrop"].nlargest(2).index  # AtP*'s ranking: by the GradDrop bound
    assert set(star.index[star["checked"] == "top"]) == set(top)
    meta = json.loads(result(tmp_path / "star", "attribute-tiny-gpt2.json").read_text())
    assert "QK fix" in meta["star_rule"] and "naive loop" in meta["why_naive"]
