"""Data: a byte-level tokenizer, the corpora, and the batch samplers.

Tokens are UTF-8 bytes (vocab 256), so every machine tokenizes identically with no vocabulary file.

Corpora (``load_corpus(manifest.data)``):

- ``stdlib`` (the default, needs no download): the ``.py`` sources of the Python standard library
  installed on this machine, sorted by relative path, tests and third-party packages excluded,
  documents joined by a NUL byte. Built once (a second or two) and cached as raw ``uint8`` files
  plus a JSON meta under ``$SWARM_NODE_CACHE`` (default ``~/.cache/swarm-node``).
- ``text``: one local text file, or a folder of them (recursive, sorted, binaries skipped).
- ``hf``: a Hugging Face ``datasets`` dataset saved with ``save_to_disk`` (there is no hub here).

Validation is held out by whole documents: a document goes to validation when a stable hash of
its name falls below ``val_fraction``, so the split never depends on file order or on which
other files exist. A corpus of a single document is split by bytes (its last fraction).

``Batches`` draws ``(B, L)`` windows at random offsets from one shard of the training stream;
shards are disjoint contiguous regions, one per head replica. The window for step ``i`` is a pure
function of ``(seed, shard, num_shards, i)``, so a resumed run sees the same data it would have.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from stages.manifest import DataConfig

DOC_SEP = b"\x00"  # never occurs in text; marks document boundaries for the model
STDLIB_MAX_BYTES = 24 * 2**20  # cap on the bundled corpus (train + val), so it builds in seconds
TEXT_MAX_BYTES = 2 * 2**30  # refuse larger text/hf corpora before reading them into memory
_CACHE_FORMAT = 1
# directory names never included in the stdlib corpus: tests, third-party code, caches, IDLE's tests
_STDLIB_SKIP_DIRS = {
    "test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
}


class DataError(ValueError):
    """The configured data cannot be loaded; the message says which path and why."""


class ByteTokenizer:
    """UTF-8 bytes as tokens: lossless on any text, no vocabulary to ship or agree on."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().to("cpu", torch.int64).reshape(-1).tolist()
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")


@dataclass
class Corpus:
    train: torch.Tensor  # uint8, 1-D
    val: torch.Tensor  # uint8, 1-D
    description: str


def default_cache_dir() -> Path:
    env = os.environ.get("SWARM_NODE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "swarm-node"


def load_corpus(cfg: DataConfig, cache_dir: Path | None = None) -> Corpus:
    """Load the corpus the manifest's ``[data]`` section names (building/caching ``stdlib``)."""
    if cfg.source == "stdlib":
        return _load_stdlib(cfg, Path(cache_dir) if cache_dir is not None else default_cache_dir())
    if cfg.source == "text":
        docs = _read_text_docs(Path(cfg.path).expanduser())
        return _split(docs, cfg.val_fraction, f"text:{cfg.path}")
    if cfg.source == "hf":
        docs = _read_hf_docs(Path(cfg.path).expanduser(), cfg.text_field)
        return _split(docs, cfg.val_fraction, f"hf:{cfg.path}[{cfg.text_field}]")
    raise DataError(f"data.source: unknown source {cfg.source!r}; known: stdlib, text, hf")


# ---------------------------------------------------------------- splitting


def _is_val(name: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(name.encode("utf-8", "surrogateescape")).digest()[:8], "big")
    return h / 2**64 < val_fraction


def _split(docs: list[tuple[str, bytes]], val_fraction: float, description: str) -> Corpus:
    """Hold out whole documents by name hash; fall back to a byte split when that leaves a side empty."""
    docs = [(n, b) for n, b in docs if b]
    if not docs:
        raise DataError(f"{description}: the corpus is empty (no non-empty documents)")
    train = [b for n, b in docs if not _is_val(n, val_fraction)]
    val = [b for n, b in docs if _is_val(n, val_fraction)]
    if train and val:
        train_b, val_b = DOC_SEP.join(train) + DOC_SEP, DOC_SEP.join(val) + DOC_SEP
        how = f"{len(train)} train / {len(val)} val documents"
    else:
        stream = DOC_SEP.join(b for _, b in docs) + DOC_SEP
        cut = len(stream) - max(1, int(len(stream) * val_fraction))
        train_b, val_b = stream[:cut], stream[cut:]
        how = f"{len(docs)} document(s), last {val_fraction:.0%} of bytes held out"
    return Corpus(
        train=_as_tensor(train_b),
        val=_as_tensor(val_b),
        description=f"{description}: {len(train_b):,} train / {len(val_b):,} val bytes ({how})",
    )


def _as_tensor(b: bytes | bytearray) -> torch.Tensor:
    if not b:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


# ---------------------------------------------------------------- stdlib corpus


def stdlib_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """Sorted ``(relative posix path, path)`` of the stdlib ``.py`` sources used for the corpus."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith(".")]
        for f in filenames:
            if f.endswith(".py") and not f.startswith("test_"):
                p = Path(dirpath) / f
                out.append((p.relative_to(root).as_posix(), p))
    out.sort(key=lambda t: t[0])
    return out


def _stdlib_key(files: list[tuple[str, Path]], val_fraction: float) -> str:
    """Cache key: the exact inputs (names and sizes) and the build rules."""
    h = hashlib.sha256()
    h.update(json.dumps([_CACHE_FORMAT, STDLIB_MAX_BYTES, val_fraction, sys.version]).encode())
    for name, p in files:
        h.update(f"{name}\t{p.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


def build_stdlib_corpus(val_fraction: float, root: Path | None = None) -> tuple[bytes, bytes, dict]:
    """Read the stdlib sources (deterministically) into train and val byte strings plus a meta dict."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    docs, total = [], 0
    for name, p in files:
        b = p.read_bytes()
        if not b or b"\x00" in b:
            continue
        if total + len(b) > STDLIB_MAX_BYTES:
            break
        docs.append((name, b))
        total += len(b)
    if not docs:
        raise DataError(
            f"data.source = 'stdlib': no Python sources found under {root}; "
            "use data.source = 'text' with data.path pointing at some text"
        )
    corpus = _split(docs, val_fraction, "stdlib")
    meta = {
        "format": _CACHE_FORMAT,
        "source": "stdlib",
        "root": str(root),
        "python": sys.version.split()[0],
        "documents": len(docs),
        "val_fraction": val_fraction,
        "train_bytes": int(corpus.train.numel()),
        "val_bytes": int(corpus.val.numel()),
        "sha256": hashlib.sha256(corpus.train.numpy().tobytes() + corpus.val.numpy().tobytes()).hexdigest(),
    }
    return corpus.train.numpy().tobytes(), corpus.val.numpy().tobytes(), meta


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _load_stdlib(cfg: DataConfig, cache_dir: Path) -> Corpus:
    files = stdlib_files()
    key = _stdlib_key(files, cfg.val_fraction)
    d = cache_dir / f"corpus-stdlib-{key}"
    meta_path = d / "meta.json"
    if meta_path.exists():
        try:
            meta = json.loads(meta_path.read_text())
            train = (d / "train.u8").read_bytes()
            val = (d / "val.u8").read_bytes()
            if len(train) == meta["train_bytes"] and len(val) == meta["val_bytes"]:
                return Corpus(_as_tensor(train), _as_tensor(val), _stdlib_description(meta, d))
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache is rebuilt below
    train, val, meta = build_stdlib_corpus(cfg.val_fraction)
    try:
        d.mkdir(parents=True, exist_ok=True)
        _atomic_write(d / "train.u8", train)
        _atomic_write(d / "val.u8", val)
        _atomic_write(meta_path, json.dumps(meta, indent=1).encode())  # written last: marks complete
    except OSError as e:  # an unwritable cache only costs a rebuild next time
        print(f"swarm-node: warning: could not cache the corpus in {d}: {e}", file=sys.stderr)
    return Corpus(_as_tensor(train), _as_tensor(val), _stdlib_description(meta, d))


def _stdlib_description(meta: dict, d: Path) -> str:
    return (
        f"stdlib (Python {meta['python']}, {meta['documents']} files): {meta['train_bytes']:,} train / "
        f"{meta['val_bytes']:,} val bytes, cached in {d}"
    )


# ---------------------------------------------------------------- text and hf corpora


def _read_text_docs(path: Path) -> list[tuple[str, bytes]]:
    if not path.exists():
        raise DataError(f"data.path: {path} does not exist (data.source = 'text' needs a text file or folder)")
    if path.is_file():
        files = [(path.name, path)]
    elif path.is_dir():
        files = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for f in filenames:
                if not f.startswith("."):
                    p = Path(dirpath) / f
                    files.append((p.relative_to(path).as_posix(), p))
        files.sort(key=lambda t: t[0])
    else:
        raise DataError(f"data.path: {path} is neither a file nor a folder")
    total = sum(p.stat().st_size for _, p in files)
    if total > TEXT_MAX_BYTES:
        raise DataError(f"data.path: {path} holds {total:,} bytes, over the {TEXT_MAX_BYTES:,}-byte limit")
    docs = []
    for name, p in files:
        b = p.read_bytes()
        if b"\x00" in b:  # binary file, not text
            continue
        docs.append((name, b))
    if not any(b for _, b in docs):
        raise DataError(f"data.path: no non-empty text files in {path}")
    return docs


def _read_hf_docs(path: Path, text_field: str) -> list[tuple[str, bytes]]:
    if not path.exists():
        raise DataError(
            f"data.path: {path} does not exist (data.source = 'hf' needs a dataset saved with save_to_disk)"
        )
    try:
        import datasets
    except ImportError as e:
        raise DataError("data.source = 'hf' needs the `datasets` package: pip install datasets") from e
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise DataError(f"data.path: {path} is not a dataset saved with save_to_disk ({e})") from e
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"data.path: {path} is a DatasetDict without a 'train' split ({list(ds)})")
        ds = ds["train"]
    if text_field not in ds.column_names:
        raise DataError(
            f"data.text_field: column {text_field!r} not in the dataset at {path}; "
            f"columns: {', '.join(ds.column_names)}"
        )
    docs, total, i = [], 0, 0
    for chunk in ds.select_columns([text_field]).iter(batch_size=1024):  # streamed, not all at once
        for text in chunk[text_field]:
            if text is not None:
                if not isinstance(text, str):
                    raise DataError(
                        f"data.text_field: column {text_field!r} row {i} is {type(text).__name__}, not text"
                    )
                b = text.replace("\x00", "").encode("utf-8")
                total += len(b)
                if total > TEXT_MAX_BYTES:
                    raise DataError(f"data.path: dataset at {path} exceeds the {TEXT_MAX_BYTES:,}-byte limit")
                docs.append((f"row{i}", b))
            i += 1
    if not any(b for _, b in docs):
        raise DataError(f"data.path: the dataset at {path} has no non-empty {text_field!r} rows")
    return docs


# ---------------------------------------------------------------- batches


class Batches:
    """Random ``(batch_size, seq_len)`` int64 windows from shard ``shard`` of ``num_shards``.

    Shard ``s`` owns the contiguous region ``[s*N/num_shards, (s+1)*N/num_shards)`` of the stream
    and every window lies inside it, so replicas never see each other's tokens. ``batch(i)`` is a
    pure function of ``(seed, shard, num_shards, i)``; iterating yields ``batch(step)`` for
    ``step = self.step, self.step + 1, ...`` (set ``step`` to resume).
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int,
                 shard: int = 0, num_shards: int = 1):
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if batch_size <= 0 or seq_len <= 0:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
        if num_shards <= 0 or not 0 <= shard < num_shards:
            raise ValueError(f"shard must be in [0, num_shards), got shard={shard} num_shards={num_shards}")
        n = tokens.numel()
        self.start = shard * n // num_shards
        self.end = (shard + 1) * n // num_shards
        if self.end - self.start < seq_len:
            raise DataError(
                f"shard {shard}/{num_shards} holds {self.end - self.start} tokens, fewer than "
                f"seq_len={seq_len}; use more data or fewer shards"
            )
        self.tokens = tokens
        self.batch_size, self.seq_len = batch_size, seq_len
        self.seed, self.shard, self.num_shards = seed, shard, num_shards
        self.step = 0
        self._arange = torch.arange(seq_len)

    def offsets(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed & (2**63 - 1), self.shard, self.num_shards, step])
        return rng.integers(self.start, self.end - self.seq_len + 1, size=self.batch_size)

    def batch(self, step: int) -> torch.Tensor:
        idx = torch.from_numpy(self.offsets(step)).unsqueeze(1) + self._arange
        return self.tokens[idx].long()

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        out = self.batch(self.step)
        self.step += 1
        return out


def val_batches(tokens: torch.Tensor, batch_size: int, seq_len: int, n: int) -> list[torch.Tensor]:
    """``n`` fixed ``(batch_size, seq_len)`` batches of evenly spaced windows over the stream."""
    if tokens.numel() < seq_len:
        raise DataError(f"validation split holds {tokens.numel()} tokens, fewer than seq_len={seq_len}")
    if n <= 0:
        return []
    offsets = torch.linspace(0, tokens.numel() - seq_len, n * batch_size).long()
    idx = offsets.unsqueeze(1) + torch.arange(seq_len)
    return list(tokens[idx].long().split(batch_size))
