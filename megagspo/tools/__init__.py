"""Command-line tools that are not part of a training run."""
