"""Context-parallel sequence-layout conversion: pure plans, data movers, and the API module ``api``."""
