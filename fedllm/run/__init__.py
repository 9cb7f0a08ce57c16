"""A run's folder and what is made from it: its policy and lock, the writer and reader of its files,
atomic checkpoints, export, model cards, reports and multi-seed comparisons."""
