"""The demo shop with a planted slow import, for `perfsleuth startup` tests
(``uvicorn startup_shop:app``)."""

import startup_slow_dep  # noqa: F401  (1 s at import)

from perfsleuth.demo.shop import app

__all__ = ["app"]
