"""`data prepare` shards: the same token streams and batches as the in-memory path, lazy reads across shard
boundaries, every source kind, and a sequential reader whose saved cursor resumes at the same token."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hybridlm import presets
from hybridlm.data.corpus import load_corpus
from hybridlm.data.loader import TokenData, batch_generator
from hybridlm.data.prepare import prepare
from hybridlm.data.sampling import SequentialWindows, make_sampler
from hybridlm.data.shards import ShardStream, ShardWriter, open_shards, shard_dtype
from hybridlm.data.token_files import read_token_file
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.errors import InputError
from hybridlm.train import TrainConfig, load_checkpoint, train


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A folder of 45 documents: text files and a jsonl (and a parquet file when pyarrow is there)."""
    d = tmp_path_factory.mktemp("src")
    for i in range(5):
        (d / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x + {j}\n" for j in range(40 + i)))
    with open(d / "notes.jsonl", "w") as f:
        for i in range(30):
            f.write(json.dumps({"text": f"note {i}: ünïcode ✓ " * (i + 1)}) + "\n")
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"text": [f"row {i} " * 20 for i in range(10)]}), d / "rows.parquet")
    except ImportError:
        pass
    return d


@pytest.fixture(scope="module")
def prepared(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards") / "data"
    prepare(str(src), str(out), shard_tokens=997, workers=2, progress=False)  # many shards, odd size
    return out


def test_prepared_streams_equal_the_in_memory_path(src, prepared):
    mem = TokenData.from_corpus(load_corpus(str(src), max_bytes=None), ByteTokenizer())
    disk = open_shards(str(prepared))
    meta = json.load(open(prepared / "meta.json"))
    assert len(meta["splits"]["train"]["shards"]) > 5 and meta["dtype"] == "uint16" and meta["eos_id"] == 256
    for split in ("train", "val"):
        a, b = mem.tokens(split), disk.tokens(split)
        assert isinstance(b, ShardStream) and all(isinstance(s, np.memmap) for s in b.shards)
        assert len(a) == len(b) and np.array_equal(a, b[:]), split
    for step in range(3):  # the random sampler draws the very same windows
        g1, g2 = batch_generator(0, step), batch_generator(0, step)
        for x, y in zip(mem.get_batch("train", 4, 64, g1), disk.get_batch("train", 4, 64, g2)):
            assert torch.equal(x, y)
    for x, y in zip(mem.sequential("val", 4, 64), disk.sequential("val", 4, 64)):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


def test_worker_count_and_shard_size_do_not_change_the_tokens(src, prepared, tmp_path):
    prepare(str(src), str(tmp_path / "one"), shard_tokens=10**9, workers=1, progress=False)
    one, many = open_shards(str(tmp_path / "one")), open_shards(str(prepared))
    assert len(one.tokens("train").shards) == 1
    assert np.array_equal(one.tokens("train")[:], many.tokens("train")[:])


def test_shard_stream_indexes_like_one_array():
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 100, n).astype(np.uint16) for n in (5, 0, 1, 17, 3)]
    whole, s = np.concatenate(parts), ShardStream(parts)
    assert len(s) == len(whole) and s.dtype == np.uint16
    for a, b in [(0, 26), (4, 7), (5, 6), (6, 24), (25, 26), (10, 10), (-3, None)]:
        assert np.array_equal(s[a:b], whole[a:b]), (a, b)
    idx = rng.integers(0, len(whole), (3, 7))
    assert np.array_equal(s[idx], whole[idx]) and s[23] == whole[23] and s[-1] == whole[-1]
    with pytest.raises(IndexError):
        s[np.array([len(whole)])]


def test_large_vocabularies_get_uint32_shards(tmp_path):
    assert shard_dtype(65536) == np.uint16 and shard_dtype(65537) == np.uint32
    w = ShardWriter(str(tmp_path), "train", shard_dtype(200_000), 4, {"vocab_size": 200_000})
    w.add(np.array([199_999, 5, 70_000, 1, 2, 3], np.int32), 1)
    files = [os.path.join(tmp_path, s["file"]) for s in w.summary()["shards"]]
    stream = ShardStream([read_token_file(f)[0] for f in files])
    assert len(files) == 2 and stream.dtype == np.uint32 and stream[:].tolist() == [199_999, 5, 70_000, 1, 2, 3]


def test_sequential_reader_resumes_at_the_same_token(prepared):
    data = open_shards(str(prepared))
    B, T = 3, 65
    a = SequentialWindows(data, B, T)
    epoch_batches = a.n_windows / B
    k = int(epoch_batches * 1.5)  # into the second epoch
    for _ in range(k):
        a.batch()
    state = a.state_dict()
    assert state["epoch"] == 1 and 0 < state["token"] < len(data.tokens("train"))
    b = SequentialWindows(data, B, T)
    b.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint stores it
    for _ in range(3):
        (x1, r1), (x2, r2) = a.batch(), b.batch()
        assert torch.equal(x1, x2) and torch.equal(r1, r2)
    # the cursor's windows are the stream itself, in order, overlapping by one token
    c = SequentialWindows(data, 2, T)
    ids, resets = c.batch()
    stream = data.tokens("train")
    assert np.array_equal(ids[0].numpy(), stream[0:T]) and np.array_equal(ids[1].numpy(), stream[T - 1:2 * T - 1])
    assert resets[0, 0] and resets[1, 1:].numpy().tolist() == (stream[T - 1:2 * T - 2] == 256).tolist()


def test_ranks_read_disjoint_parts_of_the_sequence(prepared):
    data = open_shards(str(prepared))
    single = make_sampler(data, "sequential", 4, 33)
    ranks = [make_sampler(data, "sequential", 2, 33, rank=r, world=2) for r in (0, 1)]
    for _ in range(5):
        both = torch.cat([r.batch()[0] for r in ranks])
        assert torch.equal(both, single.batch()[0])
    assert ranks[0].state_dict() == ranks[1].state_dict() == single.state_dict()


def test_training_resumes_mid_epoch_at_the_same_token(tmp_path):
    (tmp_path / "a.txt").write_text("".join(f"line {i}: {'x' * (i % 13)}\n" for i in range(250)))
    prepare(str(tmp_path / "a.txt"), str(tmp_path / "d"), shard_tokens=500, progress=False)
    data = open_shards(str(tmp_path / "d"))
    mcfg = presets.get("transformer++", n_layers=1, d_model=32, n_heads=2, vocab_size=257)
    cfg = dict(batch_size=4, seq_len=65, warmup=1, schedule="constant", eval_every=0, eval_tokens=64, log_every=1,
               data_order="sequential")
    n_windows = (len(data.tokens("train")) - 1) // 64
    steps = n_windows // 4 + 3  # crosses into the second epoch
    full = train(mcfg, TrainConfig(steps=steps, **cfg), data, str(tmp_path / "full"), progress=False)
    train(mcfg, TrainConfig(steps=steps - 4, **cfg), data, str(tmp_path / "part"), progress=False)
    pos = load_checkpoint(str(tmp_path / "part"))[1]["data_position"]
    windows = (steps - 4) * 4
    assert pos == {"order": "sequential", "epoch": windows // n_windows, "token": windows % n_windows * 64,
                   "seq_len": 65, "tokens": len(data.tokens("train"))}
    res = train(mcfg, TrainConfig(steps=steps, **cfg), data, str(tmp_path / "part"), resume=True, progress=False)
    assert res["loss"] == full["loss"]
    rows = [[json.loads(line)["loss"] for line in open(tmp_path / d / "metrics.jsonl")] for d in ("full", "part")]
    assert rows[0] == rows[1]


def test_saved_datasets_dataset_and_missing_package(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    texts = [f"document {i} " * (i + 1) for i in range(25)]
    datasets.Dataset.from_dict({"text": texts, "id": list(range(25))}).save_to_disk(str(tmp_path / "ds"))
    prepare(str(tmp_path / "ds"), str(tmp_path / "out"), progress=False)
    data = open_shards(str(tmp_path / "out"))
    want = [t for i, t in enumerate(texts) if i % 20 != 19]
    assert data.tokens("train")[:].tobytes() == b"".join(
        np.frombuffer(t.encode(), np.uint8).astype(np.uint16).tobytes() + np.uint16(256).tobytes() for t in want)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(InputError, match="pip install datasets"):
        prepare(str(tmp_path / "ds"), str(tmp_path / "out2"), progress=False)


def test_bad_inputs(prepared, tmp_path):
    with pytest.raises(InputError, match="already holds a prepared dataset"):
        prepare(str(prepared), str(prepared), progress=False)
    with pytest.raises(InputError, match="does not exist"):
        prepare(str(tmp_path / "nothing"), str(tmp_path / "o"), progress=False)
    with pytest.raises(InputError, match="no meta.json"):
        open_shards(str(tmp_path))
    import shutil
    shutil.copytree(prepared, tmp_path / "cut")
    with open(tmp_path / "cut" / "train-00001.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(InputError, match="train-00001.bin"):
        open_shards(str(tmp_path / "cut"))


def test_cli_prepare_then_train(src, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "hybridlm", "data", "prepare", str(src), "--out", str(tmp_path / "d"),
                        "--workers", "2", "--no-progress"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "train with --data" in r.stdout
    r = subprocess.run([sys.executable, "-m", "hybridlm", "train", "--preset", "transformer++", "--n-layers", "1",
                        "--d-model", "32", "--set", "n_heads=2", "--data", str(tmp_path / "d"), "--steps", "2",
                        "--seq-len", "32", "--batch-size", "2", "--eval-tokens", "64", "--data-order", "sequential",
                        "--out", str(tmp_path / "run"), "--no-progress"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert f"data    {tmp_path / 'd'}:" in r.stdout and "done    step 2" in r.stdout
    r = subprocess.run([sys.executable, "-m", "hybridlm", "eval", "--checkpoint", str(tmp_path / "run")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0 and f"of the {tmp_path / 'd'} validation split" in r.stdout, r.stderr
