"""``lightning_cp.hf``: Hugging Face integration, the same module object as ``lightning_cp.lightning.hf``.

Importing it registers the ``"lightning_cp"`` attention implementation with ``transformers``.
"""

import sys

from lightning_cp.lightning import hf

sys.modules[__name__] = hf
