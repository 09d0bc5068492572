"""Thin Lightning glue over the core: the ``cp_zigzag`` strategy and the layout callback."""
