"""Character-level language modelling on the Python standard library's own source code.

The corpus is every ``.py`` file under ``sysconfig.get_paths()["stdlib"]``, in sorted order of its
relative path, skipping installed packages (``site-packages``, ``dist-packages``), the test suites
(``test``, ``tests``, ``idle_test``) and the two packages that are data tables rather than code
(``encodings``, ``pydoc_data``); about 9M characters on CPython 3.11. No download, but it depends on
the Python version: results record the version and a SHA-256 of the corpus.

Split, fixed and by whole files so that every split mixes all parts of the library: file number
i (in the sorted order) goes to valid if i % 20 == 18, to test if i % 20 == 19, else to train
(about 90/5/5). Each split is its files concatenated, each file after a ``# file: <path>`` line.
Vocabulary: every character of the corpus, sorted by code point. Scores are bits per character
(cross-entropy in base 2).
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                       "__pycache__", "encodings", "pydoc_data"})
SPLITS = ("train", "valid", "test")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The corpus files, sorted by relative path."""
    root = stdlib_root() if root is None else Path(root)
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruned in place so the walk never enters site-packages (often far bigger than stdlib).
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_of(index: int) -> str:
    """The split of the index-th corpus file."""
    return {18: "valid", 19: "test"}.get(index % 20, "train")


def read_splits(root: Path | None = None) -> dict[str, str]:
    """The text of each split."""
    root = stdlib_root() if root is None else Path(root)
    parts: dict[str, list[str]] = {name: [] for name in SPLITS}
    for i, path in enumerate(stdlib_files(root)):
        parts[split_of(i)].append(f"# file: {path.relative_to(root).as_posix()}\n")
        parts[split_of(i)].append(path.read_text(encoding="utf-8", errors="replace"))
    texts = {name: "".join(chunks) for name, chunks in parts.items()}
    if not all(texts.values()):
        raise ValueError(f"too few Python sources under {root} to fill train/valid/test")
    return texts


def _encode(text: str, codepoints: np.ndarray) -> Tensor:
    chars = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return torch.from_numpy(np.searchsorted(codepoints, chars).astype(np.int32))


@dataclass
class Corpus:
    """The encoded splits (int32 ids), the vocabulary and the corpus' identity."""

    splits: dict[str, Tensor] = field(repr=False)
    vocab: str
    sha256: str
    python: str

    @classmethod
    def stdlib(cls, root: Path | None = None) -> Corpus:
        texts = read_splits(root)
        vocab = "".join(sorted(set().union(*texts.values())))
        codepoints = np.array([ord(c) for c in vocab], dtype=np.uint32)
        digest = hashlib.sha256()
        for name in SPLITS:
            digest.update(texts[name].encode("utf-8", errors="surrogatepass"))
        return cls(splits={name: _encode(texts[name], codepoints) for name in SPLITS},
                   vocab=vocab, sha256=digest.hexdigest(), python=sys.version.split()[0])

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def split(self, name: str) -> Tensor:
        """The ids of split ``name`` (``train``, ``valid``, ``test``)."""
        if name not in self.splits:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {name!r}")
        return self.splits[name]

    def decode(self, ids: Tensor) -> str:
        return "".join(self.vocab[i] for i in ids.tolist())


def random_windows(data: Tensor, count: int, seq_len: int, generator: torch.Generator
                   ) -> tuple[Tensor, Tensor]:
    """``count`` windows at random offsets: inputs (count, L) and next-char targets (count, L)."""
    if len(data) < seq_len + 1:
        raise ValueError(f"split of {len(data)} characters is shorter than seq_len + 1 = "
                         f"{seq_len + 1}")
    starts = torch.randint(0, len(data) - seq_len, (count,), generator=generator)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


def tiled_windows(data: Tensor, seq_len: int, max_windows: int | None = None
                  ) -> tuple[Tensor, Tensor]:
    """Consecutive non-overlapping windows covering ``data`` (each predicts its own L chars)."""
    count = (len(data) - 1) // seq_len
    if max_windows is not None:
        count = min(count, max_windows)
    if count < 1:
        raise ValueError(f"split of {len(data)} characters is shorter than seq_len + 1")
    idx = torch.arange(count)[:, None] * seq_len + torch.arange(seq_len + 1)
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]
