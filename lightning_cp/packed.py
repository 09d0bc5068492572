"""``lightning_cp.packed``: ``PackedSeqParams``, the same module object as ``lightning_cp.core.packed``."""

import sys

from lightning_cp.core import packed

sys.modules[__name__] = packed
