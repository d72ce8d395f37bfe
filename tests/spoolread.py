"""Test helper: decode a data dir's spool straight from the wire format (no store involved)
into requests whose calls carry resolved fingerprints, call sites and stacks."""

from __future__ import annotations

import glob
import os
from typing import Any

from perfsleuth.wire import FINGERPRINT, LOCATION, REQUESTS, STACK
from perfsleuth.wire.segment import read_segment


def read_spool(data_dir: str) -> list[dict[str, Any]]:
    # The agent of a test session keeps writing: a segment it closes (``.open`` renamed, by age
    # or size) between the listing and the read is read again under its new name.
    for _ in range(10):
        try:
            return _read_spool(data_dir)
        except FileNotFoundError:
            continue
    return _read_spool(data_dir)


def _read_spool(data_dir: str) -> list[dict[str, Any]]:
    locs: dict[int, dict[str, Any]] = {}
    stacks: dict[int, list[int]] = {}
    fps: dict[int, dict[str, Any]] = {}
    requests: list[dict[str, Any]] = []
    for path in sorted(glob.glob(os.path.join(data_dir, "spool", "*"))):
        if os.path.isdir(path):
            continue
        with open(path, "rb") as fh:
            res = read_segment(fh.read())
        assert not res.damaged, f"{path}: {res.damaged}"
        for rtype, obj in res.records:
            if rtype == LOCATION:
                locs[obj["id"]] = obj
            elif rtype == STACK:
                stacks[obj["id"]] = obj["frames"]
            elif rtype == FINGERPRINT:
                fps[obj["id"]] = obj
            elif rtype == REQUESTS:  # a batch: a list of requests
                requests.extend(obj)
    for req in requests:
        for call in req["calls"]:
            fp = fps[call["fp"]]
            call["fingerprint"] = fp["text"]
            call["op"] = fp["op"]
            call["site_loc"] = locs[call["site"]] if "site" in call else None
            call["stack_locs"] = [locs[i] for i in stacks[call["stack"]]] if "stack" in call else []
    requests.sort(key=lambda r: r["ts"])
    return requests
