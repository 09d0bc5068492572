"""``lightning_cp.attention``: the attention API, the same module object as ``lightning_cp.core.attention.api``."""

import sys

from lightning_cp.core.attention import api

sys.modules[__name__] = api
