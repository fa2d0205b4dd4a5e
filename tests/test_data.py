"""The data pipeline: packing, DP sharding (no token lost or duplicated), resume, sources."""

from __future__ import annotations

import copy
import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

import torchtitan_ext.data.datasets as datasets
from torchtitan_ext.data.dataloader import SequenceShardedTextDataset
from torchtitan_ext.errors import UserError
from torchtitan_ext.data.tokenizer import AssetsTokenizer

SEQ_LEN = 64


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=str(tokenizer_dir))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A local jsonl of 40 documents of very different lengths (10 to ~400 tokens)."""
    folder = tmp_path_factory.mktemp("corpus")
    words = "memory recall gradient token chunk state write read layer model".split()
    docs = [" ".join(words[(i * 7 + j) % len(words)] for j in range(5 + (i * 37) % 300)) + f" doc{i}." for i in range(40)]
    path = folder / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    return path, docs


def make(cls, tokenizer, path, rank, world, name="local"):
    return cls(dataset_name=name, dataset_path=str(path), tokenizer=tokenizer, seq_len=SEQ_LEN,
               dp_rank=rank, dp_world_size=world, infinite=False)


def drain(dataset):
    """All (input, label, position) token triples yielded, then the leftover buffers."""
    samples = list(dataset)
    tokens = [t for s, lab in samples for t in zip(s["input"].tolist(), lab.tolist(), s["positions"].tolist())]
    leftover = list(zip(dataset._inputs_buffer, dataset._labels_buffer, dataset._positions_buffer))
    return samples, tokens, leftover


def expected_pairs(tokenizer, texts):
    """(input, label) pairs that document-aware packing must produce for these documents."""
    pairs = []
    for text in texts:
        ids = tokenizer.encode(text, add_bos=True, add_eos=True)
        pairs += list(zip(ids[:-1], ids[1:]))
    return pairs


def train_docs(docs):
    return [d for d in docs if not datasets.is_heldout(d, datasets.HELDOUT_PER_MILLE["local"])]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_document_sharding_loses_and_duplicates_no_token(tokenizer, corpus, world):
    path, docs = corpus
    all_pairs = Counter()
    for rank in range(world):
        samples, tokens, leftover = drain(make(HuggingFaceTextDataset, tokenizer, path, rank, world))
        assert all(s["input"].shape == (SEQ_LEN,) for s, _ in samples)
        all_pairs.update((i, lab) for i, lab, _ in tokens + leftover)
    assert all_pairs == Counter(expected_pairs(tokenizer, train_docs(docs)))


def test_packing_puts_bos_eos_between_documents_and_restarts_positions(tokenizer, corpus):
    path, docs = corpus
    _, tokens, leftover = drain(make(HuggingFaceTextDataset, tokenizer, path, 0, 1))
    stream = tokens + leftover
    assert [(i, lab) for i, lab, _ in stream] == expected_pairs(tokenizer, train_docs(docs))
    starts = [k for k, (i, _, _) in enumerate(stream) if i == tokenizer.bos_id]
    assert len(starts) == len(train_docs(docs))
    for k, (_, label, position) in enumerate(stream):
        # a label is EOS exactly at the last input of a document
        assert (label == tokenizer.eos_id) == (k + 1 in starts or k + 1 == len(stream))
        if k < len(tokens):  # positions restart at each BOS and at each sequence start
            sequence_start = k - k % SEQ_LEN
            assert position == k - max(s for s in [*starts, sequence_start] if s <= k)


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_sharding_splits_the_single_rank_stream(tokenizer, corpus, world):
    path, _ = corpus
    single = [s["input"].tolist() for s, _ in make(SequenceShardedTextDataset, tokenizer, path, 0, 1)]
    per_rank = [[s["input"].tolist() for s, _ in make(SequenceShardedTextDataset, tokenizer, path, r, world)]
                for r in range(world)]
    interleaved = [per_rank[i % world][i // world] for i in range(sum(map(len, per_rank)))]
    assert interleaved == single


@pytest.mark.parametrize("cls,world", [(HuggingFaceTextDataset, 2), (SequenceShardedTextDataset, 2), (SequenceShardedTextDataset, 1)])
def test_resume_continues_exactly(tokenizer, corpus, cls, world):
    path, _ = corpus
    for rank in range(world):
        straight = [s["input"].tolist() for s, _ in make(cls, tokenizer, path, rank, world)]
        first = make(cls, tokenizer, path, rank, world)
        iterator = iter(first)
        head = [next(iterator)[0]["input"].tolist() for _ in range(3)]
        state = copy.deepcopy(first.state_dict())
        resumed = make(cls, tokenizer, path, rank, world)
        resumed.load_state_dict(state)
        tail = [s["input"].tolist() for s, _ in resumed]
        assert head + tail == straight and len(straight) > 3


def test_validation_split_is_disjoint_and_complete(corpus):
    path, docs = corpus
    train = list(datasets.load_local(str(path))["text"])
    held = list(datasets.load_local(str(path), validation=True)["text"])
    assert sorted(train + held) == sorted(docs) and not set(train) & set(held)


def test_embedded_corpus_has_train_and_validation_documents():
    train, held = datasets.load_embedded("embedded"), datasets.load_embedded("embedded", validation=True)
    assert len(train) > 150 and len(held) > 3
    assert not set(train["text"]) & set(held["text"])
    assert sum(map(len, train["text"])) > 10**6


def test_the_embedded_corpus_is_read_from_its_cache_file_and_rebuilt_when_the_file_is_bad(tmp_path, monkeypatch):
    """The first call extracts and writes the cache file; a later process reads the file
    without extracting; a garbled file is extracted again and rewritten. The real documents
    from the cache equal a fresh extraction."""
    from torchtitan_ext.data import embedded_corpus

    real = embedded_corpus.embedded_documents()
    assert real == tuple(embedded_corpus._extract_documents())
    extracted = []
    fake = ["alpha " * 50, "beta " * 50]
    monkeypatch.setattr(embedded_corpus, "_extract_documents", lambda: extracted.append(1) or list(fake))
    monkeypatch.setenv("MNLM_CACHE", str(tmp_path))
    path = embedded_corpus.cached_corpus_path()
    assert path.is_relative_to(tmp_path)
    for _ in range(2):  # a fresh process each time: the in-process cache cleared
        embedded_corpus.embedded_documents.cache_clear()
        assert embedded_corpus.embedded_documents() == tuple(fake) and len(extracted) == 1
    assert json.loads(path.read_text()) == fake
    path.write_text('["half a fi')
    embedded_corpus.embedded_documents.cache_clear()
    assert embedded_corpus.embedded_documents() == tuple(fake) and len(extracted) == 2
    assert json.loads(path.read_text()) == fake
    embedded_corpus.embedded_documents.cache_clear()


FINEWEB_SCHEMA = pa.schema([
    ("text", pa.string()), ("id", pa.string()), ("dump", pa.string()), ("url", pa.string()),
    ("file_path", pa.string()), ("language", pa.string()), ("language_score", pa.float64()),
    ("token_count", pa.int64()), ("score", pa.float64()), ("int_score", pa.int64()),
])


def test_fineweb_edu_loader_reads_local_parquet_with_its_schema(tmp_path, tokenizer):
    texts = [f"Photosynthesis lesson {i}: plants turn light into sugar. " * (1 + i % 5) for i in range(300)]
    rows = {
        "text": texts, "id": [f"<urn:uuid:{i}>" for i in range(300)], "dump": ["CC-MAIN-2024-10"] * 300,
        "url": [f"https://example.org/{i}" for i in range(300)], "file_path": ["s3://x.warc.gz"] * 300,
        "language": ["en"] * 300, "language_score": [0.95] * 300, "token_count": [50] * 300,
        "score": [3.1] * 300, "int_score": [3] * 300,
    }
    for shard in range(2):
        part = {k: v[shard::2] for k, v in rows.items()}
        pq.write_table(pa.table(part, schema=FINEWEB_SCHEMA), tmp_path / f"shard_{shard:05d}.parquet")
    train = list(datasets.load_fineweb_edu(str(tmp_path))["text"])
    held = list(datasets.load_fineweb_edu(str(tmp_path), validation=True)["text"])
    assert sorted(train + held) == sorted(texts) and not set(train) & set(held)
    samples = list(make(HuggingFaceTextDataset, tokenizer, tmp_path, 0, 1, name="fineweb_edu"))
    assert len(samples) > 10


def test_local_source_rejects_missing_and_mixed_paths(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        datasets.load_local(str(tmp_path / "nope"))
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.jsonl").write_text("{}")
    with pytest.raises(UserError, match="one kind"):
        datasets.load_local(str(tmp_path))


def test_fineweb_edu_download_takes_the_subsets_first_shards_resumes_and_trains_locally(tmp_path):
    from pathlib import Path

    from conftest import load_script

    download = load_script("download_fineweb_edu").download

    class FakeHub:
        files = ["README.md", "sample/10BT/001_00000.parquet", "sample/10BT/000_00000.parquet",
                 "sample/100BT/000_00000.parquet", "data/CC-MAIN-2024-10/000_00000.parquet"]

        def list_repo_files(self, repo, repo_type):
            assert (repo, repo_type) == ("HuggingFaceFW/fineweb-edu", "dataset")
            return self.files

    fetched = []

    def fetch(repo, name, repo_type, local_dir):
        fetched.append(name)
        target = Path(local_dir) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": [f"{name} document {i}" for i in range(300)]}), target)

    paths = download(tmp_path / "fw", "sample-10BT", 2, FakeHub(), fetch)
    assert fetched == ["sample/10BT/000_00000.parquet", "sample/10BT/001_00000.parquet"]
    assert all(p.is_file() for p in paths)
    download(tmp_path / "fw", "sample-10BT", 2, FakeHub(), fetch)  # complete shards are not fetched again
    assert len(fetched) == 2
    train_docs = set(datasets.load_fineweb_edu(str(tmp_path / "fw"))["text"])
    held_out = set(datasets.load_fineweb_edu(str(tmp_path / "fw"), validation=True)["text"])
    assert len(train_docs) + len(held_out) == 600 and not train_docs & held_out
    with pytest.raises(SystemExit, match="no parquet shards for subset 'sample-1T'"):
        download(tmp_path / "fw", "sample-1T", None, FakeHub(), fetch)
