"""Corpora through `datasets`: loading, per-document scoring against the plain HF model, and
the bootstrap against a direct numpy bootstrap."""

import copy
import math

import numpy as np
import pytest
import torch

from blockscope.errors import BlockscopeError
from blockscope.experiments.ablate import block_ablation
from blockscope.experiments.resid_norm import norm_distribution
from blockscope.inputs.corpus import Source, load_docs
from blockscope.sweeps.settings import RunSettings
from blockscope.sweeps.stats import Bootstrap

from ..builders import paragraphs, write_jsonl
from ..conftest import ALICE
from ..references import hf_sliding_sum, hf_stream

REL = 1e-5


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Six documents: short ones, one empty (skipped), and Alice's first paragraphs joined
    (longer than the tiny model's 128-token context: windows inside one document)."""
    p = paragraphs()
    return [p[0][:200], "", p[1][:300], "\n".join(p[:3]), p[2][:120], p[3][:250]]


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory, texts):
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "c.jsonl", texts)


def hand_summed_nll(hf, ids, n_ctx=128, stride=64) -> tuple[float, int]:
    """One document's NLL summed by hand from the plain HF model's logits: windows of
    n_ctx tokens every `stride`, each token scored once (HF's perplexity guide)."""
    total, count, done = 0.0, 0, 1  # token 0 has no prediction
    for begin in range(0, ids.shape[1], stride):
        end = min(begin + n_ctx, ids.shape[1])
        with torch.no_grad():
            logp = hf(ids[:, begin:end], use_cache=False).logits[0].double().log_softmax(-1)
        for t in range(max(done, begin + 1), end):
            total -= float(logp[t - 1 - begin, ids[0, t]])
            count += 1
        done = end
        if end == ids.shape[1]:
            break
    return total, count


def reference_sums(hf, tok, texts, bos=True) -> tuple[np.ndarray, np.ndarray]:
    sums, counts = [], []
    for t in texts:
        if not t.strip():
            continue
        ids = torch.tensor([[tok.bos_token_id] * bos + tok.encode(t, add_special_tokens=False)])
        s, n = hand_summed_nll(hf, ids)
        assert (s, n) == pytest.approx(hf_sliding_sum(hf, ids, 128, 64), rel=1e-5)
        sums.append(s)
        counts.append(n)
    return np.array(sums), np.array(counts)


def test_documents_in_order_bos_each_empty_skipped(tiny, jsonl, texts):
    docs = load_docs(Source(dataset=str(jsonl)), tiny.tokenizer)
    tok = tiny.tokenizer
    kept = [t for t in texts if t.strip()]
    want = [[tok.bos_token_id] + tok.encode(t, add_special_tokens=False) for t in kept]
    assert [d[0].tolist() for d in docs.ids] == want
    r = docs.record
    assert r["n_docs"] == 5 and r["skipped_empty"] == 1 and r["split"] == "train"
    assert r["n_tokens"] == sum(len(tok.encode(t, add_special_tokens=False)) for t in kept)
    assert r["fingerprint"] and len(r["tokens_sha256"]) == 64 and docs.unit == "document"


def test_budget_cuts_the_last_document_and_caps(tiny, jsonl, texts):
    tok = tiny.tokenizer
    first = len(tok.encode(texts[0], add_special_tokens=False))
    docs = load_docs(Source(dataset=str(jsonl), n_tokens=first + 10), tiny.tokenizer)
    assert [d.shape[1] - 1 for d in docs.ids] == [first, 10]
    assert docs.record["last_document_cut"] and docs.record["n_tokens"] == first + 10
    assert len(load_docs(Source(dataset=str(jsonl), n_docs=2), tok).ids) == 2
    plain = load_docs(Source(dataset=str(jsonl), prepend_bos=False), tok)
    assert plain.ids[0][0].tolist() == tok.encode(texts[0], add_special_tokens=False)


def test_shuffle_is_seeded(tiny, jsonl):
    tok = tiny.tokenizer

    def order(seed):
        return [d[0, 1:4].tolist() for d in load_docs(
            Source(dataset=str(jsonl), shuffle=True, seed=seed), tok).ids]

    assert order(1) == order(1)
    assert sorted(order(1)) == sorted(order(2))
    assert any(order(s) != order(1) for s in (2, 3, 4))


def test_every_local_format_gives_the_same_documents(tiny, tmp_path, jsonl, texts):
    import datasets
    import pandas as pd

    kept = [t for t in texts if t.strip()]
    frame = pd.DataFrame({"body": kept})
    frame.to_parquet(tmp_path / "c.parquet")
    frame.to_csv(tmp_path / "c.csv", index=False)
    datasets.Dataset.from_pandas(frame).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"test": datasets.Dataset.from_pandas(frame)}).save_to_disk(
        str(tmp_path / "saved-dict"))
    (tmp_path / "txts").mkdir()
    for i, t in enumerate(kept):
        (tmp_path / "txts" / f"{i:02d}.txt").write_text(t, encoding="utf-8")
    (tmp_path / "one.txt").write_text("\n\n".join(t.replace("\n", " ") for t in kept),
                                      encoding="utf-8")
    want = [d[0].tolist() for d in load_docs(Source(dataset=str(jsonl)), tiny.tokenizer).ids]
    for name, column in (("c.parquet", "body"), ("c.csv", "body"), ("saved", "body"),
                         ("saved-dict", "body"), ("txts", "text")):
        docs = load_docs(Source(dataset=str(tmp_path / name), column=column), tiny.tokenizer)
        assert [d[0].tolist() for d in docs.ids] == want, name
    one = load_docs(Source(dataset=str(tmp_path / "one.txt")), tiny.tokenizer)
    assert len(one.ids) == 5 and one.record["sample_by"] == "paragraph"


@pytest.mark.parametrize("source, message", [
    (dict(column="body"), "no column 'body'; it has text, n"),
    (dict(split="test"), "a local file has one split, train"),
    (dict(n_tokens=0), "n_tokens must be at least 1"),
])
def test_bad_corpus_options(tiny, jsonl, source, message):
    with pytest.raises(BlockscopeError, match=message):
        load_docs(Source(dataset=str(jsonl), **source), tiny.tokenizer)


def test_no_documents_and_unknown_hub_id_offline(tiny, tmp_path):
    empty = write_jsonl(tmp_path / "e.jsonl", ["", "  \n "])
    with pytest.raises(BlockscopeError, match="no non-empty documents"):
        load_docs(Source(dataset=str(empty)), tiny.tokenizer)
    with pytest.raises(BlockscopeError, match="cannot load it"):
        load_docs(Source(dataset="no-such-org/no-such-corpus"), tiny.tokenizer)
    with pytest.raises(BlockscopeError, match="not both"):
        load_docs(Source(text=ALICE, dataset=str(empty)), tiny.tokenizer)


@pytest.fixture(scope="module")
def per_document(tiny, hf, texts):
    """HF's per-document NLL sums and counts, clean and with block 1 deleted."""
    sums, counts = reference_sums(hf, tiny.tokenizer, texts)
    cut = copy.deepcopy(hf)
    del cut.transformer.h[1]
    return sums, counts, reference_sums(cut, tiny.tokenizer, texts)[0]


@pytest.mark.parametrize("engine", ["cached", "naive"])
def test_corpus_perplexity_equals_hf_per_document(tiny, jsonl, per_document, engine):
    """exp(total NLL / total tokens), each document alone (windows never cross one), with
    HF's labels= loss per document as the reference; skipping block 1 = deleting it."""
    docs = load_docs(Source(dataset=str(jsonl)), tiny.tokenizer)
    df = block_ablation(tiny, docs, settings=RunSettings(engine=engine, ci=Bootstrap(200, seed=0)))
    sums, counts, cut_sums = per_document
    assert df.loc[0, "n_scored"] == counts.sum()
    assert df.loc[0, "perplexity"] == pytest.approx(math.exp(sums.sum() / counts.sum()), rel=REL)
    assert df.loc[2, "perplexity"] == pytest.approx(math.exp(cut_sums.sum() / counts.sum()),
                                                    rel=REL)


def test_cached_engine_equals_naive_on_a_corpus_with_mean_ablation(tiny, jsonl):
    docs = load_docs(Source(dataset=str(jsonl)), tiny.tokenizer)
    kw = dict(part="attn", method="mean", layers=[0, 2])  # the first block and the last
    fast = block_ablation(tiny, docs, **kw,
                          settings=RunSettings(engine="cached", ci=Bootstrap(100, seed=3)))
    slow = block_ablation(tiny, docs, **kw,
                          settings=RunSettings(engine="naive", ci=Bootstrap(100, seed=3)))
    for column in ("perplexity", "ci_low", "ci_high", "delta_ci_low", "delta_ci_high"):
        np.testing.assert_allclose(fast[column], slow[column], rtol=REL)


def test_bootstrap_equals_a_direct_numpy_bootstrap(tiny, hf, jsonl, texts):
    """Percentile intervals over documents; the change's interval is paired (the same
    resampled documents for the variant and the baseline)."""
    docs = load_docs(Source(dataset=str(jsonl)), tiny.tokenizer)
    b = Bootstrap(500, seed=7)
    df = block_ablation(tiny, docs, layers=[0], settings=RunSettings(ci=b))  # block 0 checked
    base, counts = reference_sums(hf, tiny.tokenizer, texts)
    cut = copy.deepcopy(hf)
    del cut.transformer.h[0]
    skipped, _ = reference_sums(cut, tiny.tokenizer, texts)
    idx = np.random.default_rng(7).integers(0, len(counts), size=(500, len(counts)))
    ppl_base = np.exp(base[idx].sum(1) / counts[idx].sum(1))
    ppl_skip = np.exp(skipped[idx].sum(1) / counts[idx].sum(1))
    lo, hi = np.percentile(ppl_skip, [2.5, 97.5])
    dlo, dhi = np.percentile(ppl_skip - ppl_base, [2.5, 97.5])
    row = df.loc[1]
    assert (row.ci_low, row.ci_high) == pytest.approx((lo, hi), rel=REL)
    assert (row.delta_ci_low, row.delta_ci_high) == pytest.approx((dlo, dhi), rel=REL)
    assert row.ci_low <= row.perplexity <= row.ci_high
    assert row.delta_ci_low <= row.delta <= row.delta_ci_high
    assert df.attrs["uncertainty"]["unit"] == "document"
    assert df.attrs["uncertainty"]["n_units"] == 5


def test_bootstrap_is_seeded_and_narrows_with_more_documents(tiny, tmp_path):
    p = paragraphs()
    few = write_jsonl(tmp_path / "few.jsonl", [x[:150] for x in p[:4]])
    many = write_jsonl(tmp_path / "many.jsonl", [x[i:i + 150] for x in p for i in (0, 150, 300)
                                                  if x[i:i + 150].strip()])

    from blockscope.sweeps import scoring

    scored = {}
    for path in (few, many):  # one sweep (the baseline) per corpus, its intervals redrawn
        docs = load_docs(Source(dataset=str(path)), tiny.tokenizer)
        scored[path] = scoring.scores(tiny, docs, [], prepared=scoring.prepare(
            tiny, docs, settings=RunSettings(engine="naive")))  # the baseline: one forward

    def interval(path, seed):
        df = scored[path].frame(Bootstrap(300, seed=seed))
        return df.loc[0, "ci_low"], df.loc[0, "ci_high"]

    first = interval(few, 1)
    assert first == interval(few, 1)
    assert first != interval(few, 2)
    (a, b), (c, d) = first, interval(many, 1)
    assert d - c < b - a


def test_one_passage_resamples_128_token_chunks(tiny, alice_text):
    from blockscope.inputs.text import tokenize

    ids = tokenize(tiny.tokenizer, alice_text, prepend_bos=True, max_tokens=300)
    df = block_ablation(tiny, ids, settings=RunSettings(ci=Bootstrap(200)))
    record = df.attrs["uncertainty"]
    assert record["unit"] == "chunk" and record["n_units"] == 3  # 128 + 128 + 44 scored
    assert df.loc[0, "ci_low"] <= df.loc[0, "perplexity"] <= df.loc[0, "ci_high"]
    small = block_ablation(tiny, ids[:, :100],
                           settings=RunSettings(ci=Bootstrap(200)))  # one chunk: no interval
    assert small["ci_low"].isna().all() and "needs 2" in small.attrs["uncertainty"]["bootstrap"]


def test_resid_norm_distribution_equals_hf_hidden_states(tiny, hf, jsonl, texts):
    """Median and percentiles of the norm over every token but each document's first."""
    docs = load_docs(Source(dataset=str(jsonl), prepend_bos=False), tiny.tokenizer)
    docs.ids = [d[:, :100] for d in docs.ids]  # within the context: one window each
    df = norm_distribution(tiny, docs)
    per_point: dict[str, list] = {}
    for d in docs.ids:
        hidden, records = hf_stream(hf, d)
        per_point.setdefault("embeddings", []).append(hidden[0][0, 1:])
        for i, rec in enumerate(records):
            per_point.setdefault(f"block {i} attn", []).append((rec["in"] + rec["attn"])[0, 1:])
            per_point.setdefault(f"block {i}", []).append(rec["out"][0, 1:])
    for after, parts in per_point.items():
        norms = torch.cat(parts).norm(dim=-1).numpy()
        row = df[df["after"] == after].iloc[0]
        assert row["n_tokens"] == len(norms)
        want = np.percentile(norms, [10, 50, 90])
        assert (row["p10"], row["median"], row["p90"]) == pytest.approx(tuple(want), rel=REL)
