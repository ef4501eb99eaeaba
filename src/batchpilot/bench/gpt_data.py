"""The ``gpt`` workload's corpus: the source text of Python standard-library modules, read from this interpreter.

Nothing is downloaded. The recipe (:func:`gpt_corpus`, :func:`gpt_data`):

1. **Documents**: one per module of :data:`GPT_MODULES` (a fixed list of 48 pure-Python modules that every CPython
   3.11 ships), in that order: the module's ``.py`` file under ``sysconfig.get_paths()["stdlib"]``, read as UTF-8
   bytes, ``\\r\\n`` turned into ``\\n``.
2. **Split by document**: every 8th module (positions 7, 15, 23, ...) is validation, the rest training, so no
   text of a validation module is ever trained on. Validation keeps every 4th sample of its modules (in order),
   ~23k tokens, so that an evaluation takes a fraction of a second.
3. **Samples**: a document is cut at its blank lines (``\\n\\n``) into blocks (a function, a class header, a
   docstring, a run of imports); blocks shorter than ``min_length`` bytes are dropped and a longer block is cut
   into consecutive chunks of at most ``context + 1`` bytes. Every chunk is one variable-length sample.
4. **Tokens**: bytes (vocabulary 256). A sample of ``n + 1`` bytes is ``n`` inputs and ``n`` next-byte targets;
   its token count, what a token budget counts, is ``n``.
5. **Tensors**: ``TensorDataset(x, y)`` with ``x`` (N, context) int64 inputs padded with :data:`PAD` (256, a token
   the model embeds but never predicts) and ``y`` (N, context) int64 targets padded with :data:`IGNORE` (-100).
   :func:`token_lengths` reads the lengths back from ``y``.

The corpus is a function of the interpreter's standard library alone: the same Python 3.11 build gives the
same bytes on every machine. :func:`corpus_digest` hashes it; :data:`DEV_DIGEST` is the digest on the machine the
workload's target was set on (CPython 3.11.7). Another patch release edits a few modules, so the digest
differs and the target's calibration may be slightly off; :func:`gpt_data` then warns (it does not refuse:
the workload still trains, only its target was measured on other text).
"""

from __future__ import annotations

import hashlib
import sysconfig
import warnings
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

__all__ = ["DEV_DIGEST", "GPT_CONTEXT", "GPT_MODULES", "IGNORE", "PAD", "VOCAB", "corpus_digest", "gpt_corpus",
           "gpt_data", "samples_of", "token_lengths"]

VOCAB = 256  # byte-level
PAD = VOCAB  # the padding input: an extra embedding row, never a target
IGNORE = -100  # padded targets (torch's cross_entropy ignore_index)
GPT_CONTEXT = 64
VALIDATION_EVERY = 8
VALIDATION_STRIDE = 4

GPT_MODULES: tuple[str, ...] = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "cmd", "code", "codecs", "colorsys",
    "contextlib", "copy", "csv", "dataclasses", "difflib", "dis", "enum", "fnmatch", "fractions", "functools",
    "getopt", "gettext", "glob", "graphlib", "gzip", "heapq", "hmac", "ipaddress", "keyword", "linecache",
    "numbers", "operator", "optparse", "pathlib", "pprint", "queue", "random", "reprlib", "sched", "shlex",
    "statistics", "string", "textwrap", "timeit", "tokenize", "types", "uuid", "weakref",
)
"""The corpus's modules, in order (one document each; every 8th is validation)."""

DEV_DIGEST = "57d15693a93f001e"  # corpus_digest() under CPython 3.11.7, where the target was set


def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def gpt_corpus(modules: tuple[str, ...] = GPT_MODULES) -> list[bytes]:
    """The documents: each module's source as bytes (``\\r\\n`` -> ``\\n``), in the order of ``modules``.

    Raises:
        FileNotFoundError: a module has no ``.py`` file in this interpreter's standard library (a Python built
            without it); the message names the module and the folder.
    """
    root = _stdlib()
    docs = []
    for name in modules:
        path = root / f"{name}.py"
        if not path.is_file():
            raise FileNotFoundError(f"the gpt workload's corpus needs the standard-library module {name!r} as "
                                    f"{path}, which this Python does not have; run it with a full CPython 3.11.")
        docs.append(path.read_bytes().replace(b"\r\n", b"\n"))
    return docs


def corpus_digest(docs: list[bytes] | None = None) -> str:
    """SHA-256 (first 16 hex digits) of the documents, each prefixed by its length: the corpus's identity."""
    h = hashlib.sha256()
    for doc in gpt_corpus() if docs is None else docs:
        h.update(len(doc).to_bytes(8, "little"))
        h.update(doc)
    return h.hexdigest()[:16]


def samples_of(doc: bytes, context: int = GPT_CONTEXT, min_length: int = 16) -> list[bytes]:
    """A document's samples: its blank-line-separated blocks of at least ``min_length`` bytes, each cut into
    consecutive chunks of at most ``context + 1`` bytes (a chunk of one byte has no target and is dropped)."""
    out = []
    for block in doc.split(b"\n\n"):
        block = block.strip(b"\n")
        if len(block) < min_length:
            continue
        out += [block[i : i + context + 1] for i in range(0, len(block), context + 1)
                if len(block) - i >= 2]
    return out


def _tensors(samples: list[bytes], context: int) -> TensorDataset:
    x = torch.full((len(samples), context), PAD, dtype=torch.long)
    y = torch.full((len(samples), context), IGNORE, dtype=torch.long)
    for i, s in enumerate(samples):
        t = torch.frombuffer(bytearray(s), dtype=torch.uint8).long()
        x[i, : len(t) - 1] = t[:-1]
        y[i, : len(t) - 1] = t[1:]
    return TensorDataset(x, y)


def token_lengths(data: TensorDataset) -> list[int]:
    """Tokens (predicted positions) of every sample of a :func:`gpt_data` set: its targets that are not padding."""
    return (data.tensors[1] != IGNORE).sum(dim=1).tolist()


def gpt_data(seed: int = 0, context: int = GPT_CONTEXT, modules: tuple[str, ...] = GPT_MODULES
             ) -> tuple[TensorDataset, TensorDataset]:
    """The workload's ``(train, validation)`` sets (recipe in the module docstring). The ``seed`` is unused: the
    corpus and its split are fixed (the run seed still shuffles the training order)."""
    docs = gpt_corpus(modules)
    if modules == GPT_MODULES and corpus_digest(docs) != DEV_DIGEST:
        warnings.warn(f"the gpt corpus of this Python's standard library (digest {corpus_digest(docs)}) differs "
                      f"from the one its target was set on ({DEV_DIGEST}, CPython 3.11.7): times to target may "
                      "not compare with the documented ones.", stacklevel=2)
    train = [s for i, d in enumerate(docs) if i % VALIDATION_EVERY != VALIDATION_EVERY - 1
             for s in samples_of(d, context)]
    val = [s for i, d in enumerate(docs) if i % VALIDATION_EVERY == VALIDATION_EVERY - 1
           for s in samples_of(d, context)][::VALIDATION_STRIDE]
    return _tensors(train, context), _tensors(val, context)
