"""The context-parallel core: torch and ``torch.distributed`` only, no Lightning.

``zigzag`` owns the geometry of the two layouts, ``layout`` and ``attention`` the conversions and the attention on
zigzag shards, ``windows`` the plan of a convolution's exchange, ``sharding`` and ``step`` turn a replica batch into
one rank's step state, ``comm`` is the one module that talks to ``torch.distributed``. Any training loop can use it;
``lightning_cp.lightning`` connects it to Lightning.
"""
