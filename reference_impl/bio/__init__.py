"""Biotech components: molecular splits, masked multitask losses, ranking metrics,
sequence and graph collation, sparse genomic batches, and structure-model helpers.

Every module needs only NumPy and PyTorch, except `splits`, `graphs` and `demo`
(RDKit) and `sparse` (SciPy); install the `biotech` extra for those.
"""
