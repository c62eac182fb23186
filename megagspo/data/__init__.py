"""Prompt datasets (JSONL / parquet or the built-in synthetic task) and tokenizers."""

from .datasets import DataError, Example, PromptDataset, build_datasets, encode_examples, load_examples
from .tokenizer import BuiltinTokenizer, HFTokenizer, load_tokenizer
from .tasks import addition_examples

__all__ = ["BuiltinTokenizer", "DataError", "Example", "HFTokenizer", "PromptDataset", "addition_examples",
           "build_datasets", "encode_examples", "load_examples", "load_tokenizer"]
