"""Requests worth replaying, for tests/test_replay.py (FastAPI under uvicorn, Flask under
gunicorn: ``replay_app:app`` and ``replay_app:flask_app``), and a planted leak for heap diffs."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from flask import Flask
from flask import request as flask_request

import perfsleuth.agent as ps


class PlantedLeak:
    """Instances pile up in LEAK on every /grow: what a heap diff must show growing."""

    def __init__(self, i: int) -> None:
        self.i = i
        self.payload = b"x" * 64  # bytes are not tracked by the GC: the instances show


LEAK: list[PlantedLeak] = []


def answer(body: bytes, headers: Any) -> dict[str, Any]:
    """What the tests compare between the original and its replay: derived from the body and
    from a non-secret header, so a replay that changed either shows."""
    return {
        "sha256": hashlib.sha256(body).hexdigest(),
        "size": len(body),
        "custom": headers.get("x-custom"),
        "authorized": headers.get("authorization") is not None,
    }


app = FastAPI()


@app.get("/fast")
def fast() -> dict[str, bool]:
    return {"ok": True}


@app.post("/slow/{item_id}")
async def slow(item_id: int, request: Request) -> dict[str, Any]:
    body = await request.body()
    await asyncio.sleep(float(request.query_params.get("ms", "400")) / 1000)
    return dict(answer(body, request.headers), item_id=item_id)


@app.get("/block")
async def block() -> dict[str, bool]:
    time.sleep(0.25)  # blocks the event loop: the watchdog flags this request for capture
    return {"ok": True}


@app.get("/boom")
def boom() -> dict[str, Any]:
    raise RuntimeError("planted failure")


@app.post("/upload")
async def upload(request: Request) -> dict[str, Any]:
    body = await request.body()
    if request.query_params.get("keep"):
        ps.keep_capture()
    return answer(body, request.headers)


@app.get("/grow")
def grow(n: int = 1000) -> dict[str, int]:
    LEAK.extend(PlantedLeak(i) for i in range(n))
    return {"leaked": len(LEAK), "pid": os.getpid()}


@app.get("/pid")
def pid() -> JSONResponse:
    return JSONResponse({"pid": os.getpid()})


flask_app = Flask(__name__)


@flask_app.get("/fast")
def f_fast() -> dict[str, bool]:
    return {"ok": True}


@flask_app.post("/slow/<int:item_id>")
def f_slow(item_id: int) -> dict[str, Any]:
    body = flask_request.get_data()
    time.sleep(float(flask_request.args.get("ms", "400")) / 1000)
    return dict(answer(body, flask_request.headers), item_id=item_id)


@flask_app.post("/form")
def f_form() -> dict[str, Any]:
    form = flask_request.form.to_dict()
    ps.keep_capture()
    return {"form": json.dumps(form, sort_keys=True)}


@flask_app.get("/boom")
def f_boom() -> dict[str, Any]:
    raise RuntimeError("planted failure")


@flask_app.get("/grow")
def f_grow() -> dict[str, int]:
    LEAK.extend(PlantedLeak(i) for i in range(int(flask_request.args.get("n", "1000"))))
    return {"leaked": len(LEAK), "pid": os.getpid()}


@flask_app.get("/pid")
def f_pid() -> dict[str, int]:
    return {"pid": os.getpid()}
