"""`--method resample` against plain-transformers references: each document's half (or head)
replaced, position by position, by what the HF model's own module gave on its partner
document (captured by a forward hook on the partner's run), the corpus NLL summed over the
documents from HF's losses."""

import math

import pytest
import torch

from blockscope.errors import BlockscopeError
from blockscope.experiments.ablate import block_ablation
from blockscope.experiments.heads import prepare, single_head_ablation
from blockscope.inputs.corpus import Docs
from blockscope.inputs.text import tokenize
from blockscope.model.loading import load_model, spec_for
from blockscope.sweeps.naive import partners
from blockscope.sweeps.settings import RunSettings

from ..builders import save_checkpoint
from ..references import input_hook, layers, output_hook, sub, writes

TEXTS = ["Alice was beginning to get very tired of sitting by her sister on the bank, and",
         "of having nothing to do: once or twice she had peeped into the book her sister",
         "was reading, but it had no pictures or conversations in it, and what is the use of a "
         "book, thought Alice, without pictures or conversations?"]
SEED = 3


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def fam(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    family = request.param
    path = save_checkpoint(family, tmp_path_factory.mktemp(family) / family)
    model = load_model(spec_for(str(path), device="cpu"))
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    ids = [tokenize(model.tokenizer, t, prepend_bos=True) for t in TEXTS]
    assert len({i.shape[-1] for i in ids}) == 3  # lengths differ: the cycling is exercised
    return family, model, hf, Docs(ids, list(range(3)), unit="document")


def captured(hf, ids, module, what="output") -> torch.Tensor:
    """What `module` gave (its output, or its first input) on `ids`: (T, ...)."""
    seen = []
    if what == "output":
        h = module.register_forward_hook(
            lambda m, a, out: seen.append((out[0] if isinstance(out, tuple) else out)[0]))
    else:
        h = module.register_forward_pre_hook(lambda m, a: seen.append(a[0][0]))
    try:
        with torch.inference_mode():
            hf(ids, use_cache=False)
    finally:
        h.remove()
    return seen[0]


def hf_corpus_ppl(hf, docs, hooks_for) -> float:
    """exp(total NLL / total tokens) over the documents, document k run with hooks_for(k)."""
    total, n = 0.0, 0
    for k, ids in enumerate(docs.ids):
        handles = [register(m) for m, register in hooks_for(k)]
        try:
            with torch.inference_mode():
                loss = float(hf(ids, labels=ids, use_cache=False).loss)
        finally:
            for h in handles:
                h.remove()
        total += loss * (ids.shape[-1] - 1)
        n += ids.shape[-1] - 1
    return math.exp(total / n)


def from_partner(acts: torch.Tensor, n: int) -> torch.Tensor:
    return acts[torch.arange(n) % acts.shape[0]]


@pytest.mark.parametrize("part", ["attn", "mlp"])
def test_a_resampled_half_equals_hf_with_the_partners_output(fam, part):
    family, model, hf, docs = fam
    partner = partners(3, SEED)
    assert all(partner[k] != k for k in range(3))
    runs = {e: block_ablation(model, docs, part=part, method="resample",
                              settings=RunSettings(engine=e, seed=SEED))
            for e in ("naive", "cached")}
    module = writes(family)[0 if part == "attn" else 1]
    for layer in range(model.cfg.n_layers):
        mod = sub(layers(hf)[layer], module)
        acts = [captured(hf, docs.ids[partner[k]], mod) for k in range(3)]

        def hooks_for(k):
            fill = from_partner(acts[k], docs.ids[k].shape[-1])
            return [output_hook(mod, lambda out, x, f=fill: f[None].expand_as(out))]

        want = hf_corpus_ppl(hf, docs, hooks_for)
        for e, df in runs.items():
            assert df.loc[layer + 1, "perplexity"] == pytest.approx(want, rel=1e-5), (e, layer)
    assert "fallback" not in runs["cached"].attrs["engine"]
    assert runs["cached"].attrs["resample"]["partner_of"] == {k: partner[k] for k in range(3)}
    assert runs["cached"]["kl"].tolist() == pytest.approx(runs["naive"]["kl"].tolist(),
                                                          rel=1e-4, abs=1e-4)


def test_a_resampled_head_equals_hf_with_the_partners_slice(fam):
    family, model, hf, docs = fam
    partner, d_head = partners(3, SEED), model.cfg.d_head
    layer, head = 1, 2
    got = []
    for engine in ("cached", "naive"):
        prepared = prepare(model, docs, method="resample",
                           settings=RunSettings(seed=SEED, engine=engine))
        got.append(single_head_ablation(model, docs, method="resample", layers=[layer],
                                        heads=[head], prepared=prepared,
                                        settings=RunSettings(engine=engine)))
    mod = sub(layers(hf)[layer], writes(family)[2])  # the output projection: its input is z
    acts = [captured(hf, docs.ids[partner[k]], mod, "input") for k in range(3)]
    cols = slice(head * d_head, (head + 1) * d_head)

    def hooks_for(k):
        fill = from_partner(acts[k], docs.ids[k].shape[-1])[:, cols]

        def fn(z, f=fill):
            z = z.clone()
            z[..., cols] = f
            return z

        return [input_hook(mod, fn)]

    want = hf_corpus_ppl(hf, docs, hooks_for)
    for df in got:
        assert df.loc[1, "perplexity"] == pytest.approx(want, rel=1e-5)
    assert "fallback" not in got[0].attrs["engine"]


def test_resample_is_refused_without_a_corpus(fam):
    family, model, _, docs = fam
    with pytest.raises(BlockscopeError, match="2 or more documents"):
        block_ablation(model, docs.ids[0], part="mlp", method="resample")
    with pytest.raises(BlockscopeError, match="half's write"):
        block_ablation(model, docs, part="block", method="resample")
