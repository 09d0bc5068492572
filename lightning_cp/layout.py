"""``lightning_cp.layout``: the layout API, the same module object as ``lightning_cp.core.layout.api``.

Aliased rather than re-exported so that patching a name here (``monkeypatch.setattr(layout, "contiguous_to_zigzag",
...)``) is seen by the manager, which looks its converters up in that module at call time.
"""

import sys

from lightning_cp.core.layout import api

sys.modules[__name__] = api
