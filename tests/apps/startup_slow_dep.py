"""A planted slow import for `perfsleuth startup` tests: 1 s of waiting when first imported
(long enough that the CPU-bound imports of a busy machine do not overtake it)."""

import time

time.sleep(1.0)
LOADED = True
