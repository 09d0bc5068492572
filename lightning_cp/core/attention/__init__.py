"""Context-parallel attention on zigzag shards: the API module ``api`` and the local block kernels ``kernels``."""
