"""Analysis: detectors that say why an endpoint is slow (:func:`find`), and the call-site
tree of an endpoint's calls (:mod:`perfsleuth.analysis.calltree`)."""

from perfsleuth.analysis.config import DEFAULTS, Config, ConfigError, load_config
from perfsleuth.analysis.finding import Finding, stable_id
from perfsleuth.analysis.findings import find

__all__ = ["DEFAULTS", "Config", "ConfigError", "Finding", "find", "load_config", "stable_id"]
