"""Fingerprints, coalescing, caches, similarity grouping, combined prompts and splitting."""
