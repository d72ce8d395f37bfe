"""A planted slow import for `perfsleuth startup` tests: 0.4 s of work when first imported."""

import time

time.sleep(0.4)
LOADED = True
