"""Corpora, tokenizers and token datasets with stable sample ids.

```python
from qwire.data import build_datasets, iterate_batches
train_ds, val_ds, tokenizer = build_datasets(corpus="stdlib", seq_len=128, vocab_size=4096)
for input_ids, labels, sample_ids in iterate_batches(train_ds, batch_size=8, seed=0, epoch=0):
    ...
```
"""

from .corpus import CorpusSpec, corpus_stats, iter_documents, parse_corpus_spec
from .dataset import (
    TokenDataset,
    build_datasets,
    default_cache_dir,
    epoch_order,
    iterate_batches,
    num_batches,
    split_windows,
)
from .tokenizer import EOS_TOKEN, TextTokenizer, load_pretrained_tokenizer

__all__ = [
    "EOS_TOKEN",
    "CorpusSpec",
    "TextTokenizer",
    "TokenDataset",
    "build_datasets",
    "corpus_stats",
    "default_cache_dir",
    "epoch_order",
    "iter_documents",
    "iterate_batches",
    "load_pretrained_tokenizer",
    "num_batches",
    "parse_corpus_spec",
    "split_windows",
]
