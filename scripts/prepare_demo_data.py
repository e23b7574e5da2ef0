"""Build a Megatron indexed dataset (.bin/.idx) of real documents found on any machine with Python.

Documents: every top-level function and class of the Python standard library's source files (real
code with long-tailed lengths: many short helpers, a few very long classes). Tokenizer: UTF-8 bytes
(ids 0-255) followed by an end-of-document token 256, so nothing is downloaded; train with
``--tokenizer-type NullTokenizer --vocab-size 257``. Written with Megatron's own
``IndexedDatasetBuilder``; deterministic (files and definitions in sorted order).

    python scripts/prepare_demo_data.py --out data/demo/pystdlib [--max-docs N]
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

EOD = 256
VOCAB_SIZE = 257


def iter_documents(root: Path):
    """Source text of each top-level def/class of the ``.py`` files under ``root`` (sorted)."""
    for path in sorted(root.rglob("*.py")):
        if any(part in ("test", "tests", "site-packages", "idlelib") for part in path.parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                seg = ast.get_source_segment(text, node)
                if seg:
                    yield seg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="data/demo/pystdlib", help="output prefix (.bin/.idx added)")
    ap.add_argument("--source", default=sysconfig.get_paths()["stdlib"],
                    help="directory of Python files (default: this Python's standard library)")
    ap.add_argument("--max-docs", type=int, default=0, help="stop after this many documents (0: all)")
    args = ap.parse_args(argv)

    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(get_bin_path(str(out)), dtype=np.uint16)
    lengths = []
    for text in iter_documents(Path(args.source)):
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        ids = np.append(ids, EOD)
        builder.add_item(torch.from_numpy(ids))
        builder.end_document()
        lengths.append(len(ids))
        if args.max_docs and len(lengths) >= args.max_docs:
            break
    if not lengths:
        sys.stderr.write(f"prepare_demo_data: no documents found under {args.source}\n")
        return 1
    builder.finalize(get_idx_path(str(out)))
    lens = np.array(lengths)
    stats = {"prefix": str(out), "documents": len(lens), "tokens": int(lens.sum()),
             "vocab_size": VOCAB_SIZE, "eod": EOD, "source": args.source,
             "length_percentiles": {str(q): int(np.percentile(lens, q)) for q in (10, 50, 90, 99, 100)}}
    Path(str(out) + ".json").write_text(json.dumps(stats, indent=1))
    sys.stdout.write(json.dumps(stats) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
